"""The published figures, rendered from the benchmark runs committed under ``docs/benchmarks/``.

Every table of measured figures in ``README.md`` and the pages under ``docs/`` that comes from a
committed run sits between two marker comments::

    <!-- figures:NAME -->
    ...the rendered table and a line naming the runs behind it...
    <!-- /figures:NAME -->

``python docs/render_figures.py`` rewrites every marked block in place from the JSON
(``docs/figure_tables.py``: ``TABLES`` maps NAME to the function that renders it);
``python docs/render_figures.py --check`` rewrites nothing and exits 1, naming each file and
table, when a block differs from what the JSON gives (``tests/test_figures.py`` runs it; the docs
build runs it too, ``on_pre_build`` below). Edit the JSON (a new run), never the block.

Raises ``ValueError`` for a marker without its end or a NAME no table has, and what
``figure_tables`` raises for a run file that lacks what its table reads.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
from typing import Any

if str(pathlib.Path(__file__).resolve().parent) not in sys.path:  # docs/: figure_tables
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from figure_tables import TABLES, Runs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- figures:([a-z0-9-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)
OPEN = re.compile(r"<!-- figures:([a-z0-9-]+) -->")


# ---- rewriting and checking -------------------------------------------------------------------

def pages(root: pathlib.Path) -> list[pathlib.Path]:
    """README.md and every Markdown page under docs/."""
    found = [root / "README.md"] if (root / "README.md").exists() else []
    return found + sorted((root / "docs").rglob("*.md"))


def render(name: str, root: pathlib.Path) -> str:
    """The body of block NAME (between its markers), blank lines around it."""
    if name not in TABLES:
        raise ValueError(f"no table named {name!r}; known: {', '.join(TABLES)}")
    return "\n" + "\n".join(TABLES[name](Runs(root))) + "\n\n"


def rewrite(text: str, root: pathlib.Path, where: str) -> tuple[str, list[str]]:
    """``text`` with every marked block rendered, and the names of the blocks that changed."""
    opened = OPEN.findall(text)
    closed = re.findall(r"<!-- /figures:([a-z0-9-]+) -->", text)
    if sorted(opened) != sorted(closed):
        raise ValueError(f"{where}: figure markers without their pair: opened {opened}, "
                         f"closed {closed}")
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        body = render(m.group(2), root)
        if body != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + body + m.group(4)

    new = BLOCK.sub(sub, text)
    return new, changed


def run(root: pathlib.Path, write: bool) -> list[str]:
    """Render every page under ``root``; return ``file: table`` for each block that differed.

    With ``write`` the pages are rewritten in place. A table in ``TABLES`` that no page holds is
    reported as ``(no page): NAME``.
    """
    stale, seen = [], set()
    for page in pages(root):
        text = page.read_text()
        if "<!-- figures:" not in text:
            continue
        rel = page.relative_to(root).as_posix()
        new, changed = rewrite(text, root, rel)
        seen.update(OPEN.findall(text))
        stale += [f"{rel}: {name}" for name in changed]
        if write and new != text:
            page.write_text(new)
    stale += [f"(no page): {name}" for name in TABLES if name not in seen]
    return stale


def on_pre_build(config: Any) -> None:
    """MkDocs hook: the site is not built from figures that differ from their runs."""
    from mkdocs.exceptions import PluginError

    stale = run(ROOT, write=False)
    if stale:
        raise PluginError("figures differ from docs/benchmarks/*.json (python "
                          "docs/render_figures.py rewrites them): " + "; ".join(stale))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="rewrite nothing; exit 1 naming each table that differs from its JSON")
    ap.add_argument("--root", type=pathlib.Path, default=ROOT,
                    help="the repository root (README.md, docs/, docs/benchmarks/)")
    a = ap.parse_args(argv)
    stale = run(a.root, write=not a.check)
    if a.check:
        if stale:
            print("figures differ from their JSON (run python docs/render_figures.py):",
                  file=sys.stderr)
            for s in stale:
                print(f"  {s}", file=sys.stderr)
            return 1
        print("every rendered figure matches its JSON")
        return 0
    for s in stale:
        print(f"rewrote {s}" if not s.startswith("(no page)") else f"not on any page: {s}")
    return 1 if any(s.startswith("(no page)") for s in stale) else 0


if __name__ == "__main__":
    sys.exit(main())
