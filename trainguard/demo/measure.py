"""Timing one fault's recovery from the job's events: injection → first anomaly (detected) →
newest decision (decided) → every rank of the new world training again (resumed), with the
steps rolled back and the path the state came back by (``peer``, ``checkpoint``)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from trainguard import schemas


class RecoveryTiming:
    """The measuring step of ``trainguard.demo.harness.Demo``, which provides ``cfg``, ``rec``,
    ``launchers``, ``say`` and ``full_restart`` (observe mode: what a scheduler alone does)."""

    def timeline(self, f: dict[str, Any], injected: int | None, wait: bool = True) -> dict:
        """Wait for detection, decision and resumption after a fault injected at ``injected``
        (``wait=False``: the empty row of a fault that could not be injected)."""
        cfg = self.cfg
        out = {**dict.fromkeys(("detected_ns", "decided_ns", "resumed_ns", "steps_rolled_back",
                                "restored_step", "resumed_step", "path", "decision", "verdict")),
               "kind": f["kind"], "rank": f["rank"], "step": f["step"],
               "node": f"node{f.get('node', f['rank'] // cfg.nproc_per_node)}",
               "injected_ns": injected, "recovered": False, "path_reason": "",
               **{k: f[k] for k in ("used_mib", "budget_mib", "fill_mib") if k in f}}
        if not wait:
            return out
        deadline = time.monotonic() + cfg.recovery_timeout_s
        decision = None
        full_restart_done = False
        while time.monotonic() < deadline:
            anomalies = self.rec.of(schemas.Anomaly, injected)
            if anomalies and out["detected_ns"] is None:
                out["detected_ns"] = min(a.ts for a in anomalies)
            verdicts = self.rec.of(schemas.Verdict, injected)
            if verdicts:
                # the verdict behind the newest decision (else the first one)
                v = next((x for x in verdicts if decision is not None
                          and x.event_id == decision.verdict_id), None) or verdicts[0]
                out["verdict"] = {"fault_class": v.fault_class, "layer": v.layer,
                                  "culprit_ranks": v.culprit.ranks,
                                  "culprit_nodes": v.culprit.nodes}
            decisions = self.rec.of(schemas.Decision, injected)
            if decisions and (decision is None or decisions[-1].generation > decision.generation):
                # the newest decision is the one recovery follows (a node loss is first seen as
                # its ranks falling silent, then excluded when the node's heartbeats are gone)
                decision = max(decisions, key=lambda d: (d.generation, d.ts))
                out["decided_ns"] = decision.ts
                out["decision"] = {"action": decision.action, "ranks": decision.ranks,
                                   "nodes": decision.nodes, "generation": decision.generation,
                                   "world_size": decision.world_size,
                                   "executed": decision.execute, "reason": decision.reason}
                out["decisions"] = [d.action for d in decisions]
            if decision is not None and decision.action == "stop_job_notify_user":
                out["stopped"] = True  # the job was stopped on purpose: nothing to resume
                break
            if cfg.mode == "observe" and not full_restart_done and (
                    decision is not None or all(p.poll() is not None for p in self.launchers)):
                self.say(f"observe mode: decision would be "
                         f"{decision.action if decision else '(none yet)'}; restarting the whole "
                         f"job from its last checkpoint, as a scheduler would")
                self.full_restart()
                full_restart_done = True
                since = time.time_ns()
            if cfg.mode == "action" and decision is not None:
                resumed = [r for r in self.rec.of(schemas.TrainingResumed, injected)
                           if r.generation >= decision.generation]
            elif cfg.mode == "observe" and full_restart_done:
                resumed = self.rec.of(schemas.TrainingResumed, since)
            else:
                resumed = []
            replaceable = cfg.spare_nodes > 0 and cfg.mode == "action"
            if f["kind"] == "straggler" and not replaceable:
                # a straggler is flagged (replaced only where a spare node exists): the figure
                # is the time to the verdict naming it; then the rank is made fast again.
                # With a spare node it is timed like a node loss: until the job trains again
                # on the spare (the slow rank's node excluded).
                named = [v for v in verdicts if f["rank"] in v.culprit.ranks]
                if named or time.monotonic() > deadline - 1:
                    out["recovered"] = bool(named)
                    node, local = f["rank"] // cfg.nproc_per_node, f["rank"] % cfg.nproc_per_node
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(cfg.run_dir, f"slow-node{node}-{local}"))
                    break
                time.sleep(0.01)
                continue
            world = decision.world_size if decision is not None and decision.world_size else \
                cfg.world_size
            ranks = {r.rank for r in resumed}
            if len(ranks) >= world:
                out["resumed_ns"] = max(r.ts for r in resumed)
                # the ranks' own count, and at least the fault's step minus the restored one
                # (a rank replaced from a spare cannot know the step its predecessor reached)
                out["steps_rolled_back"] = max(
                    [max(0, f["step"] - min(r.restored_step for r in resumed))] +
                    [r.steps_rolled_back for r in resumed if cfg.mode == "action"])
                out["restored_step"] = min(r.restored_step for r in resumed)
                out["resumed_step"] = min(r.resumed_step for r in resumed)
                paths = sorted({r.path for r in resumed})  # "checkpoint", "peer" or both
                out["path"] = "+".join(paths)
                out["path_reason"] = next((r.reason for r in resumed if r.rank == 0), "")
                out["recovered"] = True
                break
            time.sleep(0.01)
        if injected:
            from trainguard.core import timeline

            out["timeline"] = timeline.build(
                injected, self.rec.of(schemas.Event, injected),
                decision_id=decision.event_id if decision is not None else "").to_dict()
        return out
