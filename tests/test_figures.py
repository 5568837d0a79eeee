"""The published figures: every rendered table in README.md and docs/ is what its committed JSON
under docs/benchmarks/ gives, and the check notices a number changed on either side."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "render_figures.py"


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def figures():
    return _module("render_figures", SCRIPT)


@pytest.fixture(scope="module")
def tables(figures):
    return sys.modules["figure_tables"]  # docs/figure_tables.py, imported by render_figures


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """README.md and docs/ (pages and run files) copied to a scratch repository root."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs",
                    ignore=shutil.ignore_patterns("*.png", "__pycache__"))
    return tmp_path


def test_every_rendered_figure_matches_its_json():
    r = _check(ROOT)
    assert r.returncode == 0, r.stderr + r.stdout


def test_every_table_is_on_a_page(figures, tables):
    text = "\n".join(p.read_text() for p in figures.pages(ROOT))
    for name in tables.TABLES:
        assert f"<!-- figures:{name} -->" in text, f"table {name} is on no page"
    assert "<!-- figures:headline -->" in (ROOT / "README.md").read_text()


def test_a_changed_run_fails_the_check_naming_its_tables(copy):
    path = copy / "docs" / "benchmarks" / "tails-partition-30.json"
    rows = json.loads(path.read_text())
    run = next(r for r in rows[0]["runs"] if r["again_s"] is not None)
    run["again_s"] = 9.87  # a new slowest recovery: the range's top changes
    path.write_text(json.dumps(rows))

    r = _check(copy)
    assert r.returncode == 1
    assert "README.md: headline" in r.stderr, r.stderr
    assert "docs/benchmarks.md: tails-partition" in r.stderr, r.stderr
    assert "docs/checkpoints.md" not in r.stderr  # its JSON did not change

    w = subprocess.run([sys.executable, str(SCRIPT), "--root", str(copy)], capture_output=True,
                       text=True, timeout=120)
    assert w.returncode == 0, w.stderr
    assert "–9.87) s" in (copy / "README.md").read_text()
    assert _check(copy).returncode == 0


def test_a_number_edited_by_hand_in_a_block_fails_the_check(copy):
    page = copy / "docs" / "operations" / "ha.md"
    text = page.read_text()
    block = re.search(r"<!-- figures:ha -->.*?<!-- /figures:ha -->", text, re.S).group(0)
    edited = block.replace("| 5.21 |", "| 4.21 |", 1)
    assert edited != block
    page.write_text(text.replace(block, edited))

    r = _check(copy)
    assert r.returncode == 1
    assert "docs/operations/ha.md: ha" in r.stderr, r.stderr


def test_an_unpaired_marker_is_an_error(copy, figures):
    page = copy / "docs" / "fleet-guard.md"
    page.write_text(page.read_text().replace("<!-- /figures:fleet -->", ""))
    with pytest.raises(ValueError, match="without their pair"):
        figures.run(copy, write=False)


def test_the_runs_line_names_commit_machine_and_date(copy, tables):
    path = copy / "docs" / "benchmarks" / "fleet.json"
    data = json.loads(path.read_text())
    r = tables.Runs(copy)
    r("fleet.json")
    assert "commit not recorded" in tables.runs_line(r)
    assert "date not recorded" in tables.runs_line(r)
    data["provenance"] = {"commit": "0123456789abcdef", "dirty": False,
                          "date": "2026-12-08T10:00:00Z", "cpus": 16,
                          "loadavg_start": [1.5, 1.0, 1.0], "loadavg_end": [3.25, 2.0, 1.0]}
    path.write_text(json.dumps(data))
    line = tables.runs_line(r)
    assert "commit 0123456" in line and "2026-12-08" in line, line
    assert "1-min load 1.5–30.3" in line  # the older readings in its conditions are kept


def test_a_bench_records_its_commit_machine_and_date():
    prov = _module("bench_provenance", ROOT / "bench" / "provenance.py")
    rec = prov.record(prov.loadavg())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert rec["commit"] == (head or None)
    assert rec["cpus"] == os.cpu_count()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", rec["date"])
    assert len(rec["loadavg_start"]) == 3 and len(rec["loadavg_end"]) == 3
