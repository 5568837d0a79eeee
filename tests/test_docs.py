"""The documentation: the README stays short and its links resolve; the MkDocs site builds in
strict mode (every link and anchor resolves) with its reference pages generated from the code."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
# [text](target) and ![alt](target); a target ends at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _gen():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import gen_reference
    finally:
        sys.path.pop(0)
    return gen_reference


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines, at most {MAX_README_LINES}: move "
                                   f"the detail to a page under docs/ and link it")


def test_readme_links_resolve():
    text = README.read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", text, re.M)}
    targets = LINK.findall(text)
    assert targets, "no links found in README.md: the pattern no longer matches"
    broken = []
    for target in targets:
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, frag = target.partition("#")
        if not path:
            if frag not in anchors:
                broken.append(f"{target} (no heading with that anchor)")
        elif not (ROOT / path).exists():
            broken.append(f"{target} (no file {path})")
    assert not broken, "README.md links that resolve to nothing: " + ", ".join(broken)


def test_readme_keeps_the_quick_start():
    text = README.read_text()
    for line in ("make demo", "make test", "download.pytorch.org/whl/cpu", "trainguard launch",
                 "trainguard.run(train)"):
        assert line in text, f"README.md no longer says {line!r}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "TORCH_INDEX" in makefile


def test_cli_reference_walks_the_real_parsers():
    gen = _gen()
    from trainguard.launch import args as launch_args

    p = gen.capture_parser(lambda argv: launch_args.build_parser("x").parse_args(argv), [])
    flags = {s for a in p._actions for s in a.option_strings}
    assert {"--nproc-per-node", "--nproc_per_node", "--mode", "--spares"} <= flags
    page = gen.cli_page()
    from trainguard import cli

    for name in cli.COMMANDS:
        assert f"### `trainguard {name}`" in page, name
    # sub-parsers are walked: credentials issue/revoke, replay record/play, and the dispatched decide
    for sub in ("trainguard credentials issue", "trainguard replay record",
                "trainguard replay decide", "trainguard node readmit"):
        assert f"`{sub}`" in page, sub
    assert "`--nproc-per-node`" in page
    # a dispatched sub-command shows its real parser, once (not the stub that carries its help)
    assert page.count("#### `trainguard replay decide`") == 1
    assert "`--job-record`" in page


def test_environment_scan_finds_reads_and_sets_not_stream_names():
    found = _gen().env_scan()
    kinds = {v: {k for _, _, k, _ in uses} for v, uses in found.items()}
    assert "set" in kinds["TG_CKPT_DIR"]        # handed to every rank by the launcher
    assert "read" in kinds["TG_SLURM_REQUEUE"]
    assert any(d == "'auto'" for *_, d in found["TG_SLURM_REQUEUE"])
    assert "TG_RDZV_TOKEN" in found             # named by credentials.RDZV_TOKEN_ENV
    for stream in ("TG_EVENTS", "TG_TELEMETRY", "TG_DLQ"):  # JetStream streams, not variables
        assert stream not in found


def test_mkdocs_strict_build(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed "
                                           "(pip install -e '.[docs]')")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(site)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    # the generated reference is in the site, from the code's tables
    cli_html = (site / "reference/cli/index.html").read_text()
    assert "trainguard launch" in cli_html and "--nproc-per-node" in cli_html
    from trainguard import schemas
    from trainguard.security import roles
    from trainguard.remediator import policy_table

    roles_html = (site / "reference/roles/index.html").read_text()
    assert all(name in roles_html for name in roles.ROLES)
    policy_html = (site / "reference/policy/index.html").read_text()
    assert all(r.source.split(":")[0][:40].replace("'", "&#39;") in policy_html
               or r.action in policy_html for r in policy_table.TABLE)
    exported = json.loads((site / "reference/schemas/decision.json").read_text())
    assert exported == schemas.json_schemas()["decision"]
    # the README's pictures and the pages it links are in the site
    for page in ("getting-started", "launch", "run", "recovery", "benchmarks",
                 "operations/security", "operations/deploy"):
        assert (site / page / "index.html").exists(), page
    deploy_html = (site / "operations/deploy/index.html").read_text()
    assert "Run a training job on your cluster" in deploy_html  # deploy/README.md included


def test_compose_page_quotes_the_compose_file():
    """docs/operations/compose.md repeats the steps written at the head of docker-compose.yml:
    each of its command lines must still be there."""
    page = (ROOT / "docs/operations/compose.md").read_text()
    block = page.split("```bash\n", 1)[1].split("```", 1)[0]
    head = (ROOT / "docker-compose.yml").read_text().split("\nname:", 1)[0]
    quoted = {line[1:].strip() for line in head.splitlines() if line.startswith("#")}
    stale = [line for line in block.splitlines() if line.strip() and line.strip() not in quoted]
    assert not stale, f"compose.md lines no longer at the head of docker-compose.yml: {stale}"
