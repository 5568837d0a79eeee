"""``trainguard.rank.job_imports``: what a rank records, what the launcher lets the template import
(row by row of the deny table), and the template-side import with its budget."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from trainguard.rank import job_imports
from trainguard.rank.job_imports import DENY, select


@pytest.mark.parametrize("name", sorted(DENY))
def test_every_denied_module_and_its_submodules_are_skipped_with_the_tables_reason(name):
    chosen, skipped = select([[name, "lib"], [name + ".sub", "lib"], ["json", "lib"]])
    assert chosen == ["json"]
    assert skipped == {name: DENY[name]}


def test_select_keeps_the_jobs_order_and_skips_its_own_code_and_what_is_there():
    entries = [["numpy", "lib"], ["numpy.linalg", "lib"], ["mylib", "job"],
               ["mylib.data", "job"], ["torch.nn", "lib"], ["wandb.sdk", "lib"]]
    chosen, skipped = select(entries, have={"torch.nn"})
    assert chosen == ["numpy", "numpy.linalg"]
    assert skipped == {"mylib": "the job's own code, not an installed package",
                       "wandb": DENY["wandb"]}


def test_a_malformed_record_is_refused():
    with pytest.raises(ValueError):
        select([["ok", "lib"], "not a pair"])


def test_a_rank_records_what_it_imported_beyond_its_baseline(tmp_path):
    """A real process: ``baseline``, then the script's imports (a package of its own beside it,
    a standard module), then ``record``: the file lists the new modules in order, marked."""
    (tmp_path / "ownpkg").mkdir()
    (tmp_path / "ownpkg" / "__init__.py").write_text("")
    out = tmp_path / "imports.json"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from trainguard.rank import job_imports
        job_imports.baseline()
        import wave, ownpkg
        assert job_imports.record({str(out)!r})
        assert not job_imports.record({str(out)!r})  # once per process
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    rec = json.loads(out.read_text())
    mods = dict(map(tuple, rec["modules"]))
    assert mods["wave"] == "lib" and mods["ownpkg"] == "job"
    assert "sys" not in mods and "trainguard.rank.job_imports" not in mods
    names = [n for n, _ in rec["modules"]]
    assert names.index("wave") < names.index("ownpkg")


def test_import_all_stops_at_its_budget_and_names_failures():
    s = job_imports.import_all(["json", "no_such_module_x", "wave"], budget_s=0.0)
    assert s["over_budget"] >= 2 and s["n_failed"] == 0  # the first is tried, then the budget
    s = job_imports.import_all(["no_such_module_x", "wave"], budget_s=30.0)
    assert s["n_failed"] == 1 and "no_such_module_x" in s["failed"]
    assert "wave" in sys.modules
    assert job_imports.import_file("/nonexistent/list.json", 5.0)["error"]
