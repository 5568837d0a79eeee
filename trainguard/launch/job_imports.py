"""One launcher's side of the job's own imports (``trainguard.rank.job_imports``).

``JobImportsWatch`` waits for local rank 0's record (``job_imports.json`` in the run directory,
written at its first optimizer step), chooses what the spares' template may import
(``job_imports.select``), asks the template to import it (``ForkServer.import_modules``) and,
once it has, posts ``RenewSpares`` so that the run loop replaces the idle spares forked before.
It says each step in the launch log. A template whose import started a thread or initialised
CUDA (a forked child would carry neither) is reported through ``on_taint``: the pool then starts
spares cold. Runs on its own thread; never forks (forking stays on the launcher's main thread).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Callable

from trainguard.rank import job_imports
from trainguard.launch.loop import RenewSpares

__all__ = ["JobImportsWatch"]


class JobImportsWatch:
    """``start(path)`` once per launch (later calls do nothing); ``close()`` at the end.

    Args:
        node: this node's name (the log's tag).
        budget_s: seconds the template may spend importing.
        template: returns the pool's ``ForkServer`` (None: spares start cold).
        post: queues an event for the run loop.
        on_taint: called with why the template may no longer fork spares.
    """

    def __init__(self, node: str, budget_s: float, template: Callable[[], Any],
                 post: Callable[[object], None], on_taint: Callable[[str], None]):
        self.node, self.budget_s = node, budget_s
        self._template, self._post, self._on_taint = template, post, on_taint
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def _say(self, text: str) -> None:
        print(f"trainguard launch [{self.node}]: {text}", file=sys.stderr, flush=True)

    def start(self, path: str) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, args=(path,), daemon=True,
                                            name="tg-job-imports")
            self._thread.start()

    def close(self) -> None:
        self._closing.set()

    def _watch(self, path: str) -> None:
        while not os.path.exists(path):
            if self._closing.wait(0.25):
                return
        try:
            with open(path) as fh:
                rec = json.load(fh)
            chosen, skipped = job_imports.select(rec["modules"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._say(f"cannot read the job's imports from {path} ({exc}): the spares keep "
                      f"only their own")
            return
        tops = list(dict.fromkeys(n.partition(".")[0] for n in chosen))
        what = (f"the job's ranks imported {len(chosen)} more modules (top level: "
                f"{', '.join(tops[:12])}{' …' if len(tops) > 12 else ''})")
        template = self._template()
        if template is None or not template.wait_ready():
            self._say(f"{what}; the spares start cold here, so they are not pre-imported")
            return
        listing = path[:-len(".json")] + ".chosen.json"
        try:
            with open(listing, "w") as fh:
                json.dump(chosen, fh)
        except OSError as exc:
            self._say(f"{what}; cannot write {listing} ({exc}): not pre-imported")
            return
        why = "; ".join(f"{k} ({v})" for k, v in skipped.items()) or "none"
        self._say(f"{what}: the spares' template imports them (budget {self.budget_s:g} s); "
                  f"skipped: {why}")
        template.import_modules(listing, self.budget_s, self._on_warmed)

    def _on_warmed(self, summary: dict) -> None:
        """The template's summary (``job_imports.import_all``), from its reader thread."""
        if summary.get("error"):
            self._say(f"the spares' template could not import the job's modules: "
                      f"{summary['error']}")
        else:
            failed = summary.get("n_failed", 0)
            first = "; ".join(f"{k}: {v}" for k, v in list(summary.get("failed", {}).items())[:3])
            self._say(f"the spares' template imported {summary.get('imported', 0)} of the job's "
                      f"modules in {summary.get('seconds', 0):.1f} s"
                      + (f", {failed} failed ({first})" if failed else "")
                      + (f", {summary['over_budget']} not tried (over the budget)"
                         if summary.get("over_budget") else "")
                      + "; renewing the idle spares")
        taint = []
        if summary.get("cuda"):
            taint.append("CUDA was initialised")
        if summary.get("threads"):
            taint.append(f"threads were started by {summary['threads'][:5]}")
        if taint:
            why = " and ".join(taint)
            self._on_taint(why)
            self._say(f"importing the job's modules in the spares' template: {why}, which a "
                      f"forked rank would not carry: spares start cold from now on")
        self._post(RenewSpares())
