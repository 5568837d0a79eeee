"""The goodput ledger of a job: from its events, how much of the GPU time trained the model and
where each incident's time went. Pure: no I/O, no clock (every time is an event's ``ts``, Unix
ns).

Inputs (``ledger(events)``), any order, other types ignored:

* ``rank.heartbeat`` — the steps: ``step`` (last completed) at ``progress_ts`` (else ``ts``);
* ``decision`` — an incident: ``fault_ts`` (the fault), ``detected_ts`` (its first anomaly),
  ``ts`` (decided), ``world_size``, ``generation``;
* ``recovery.resumed`` — the end of an incident: the first resumed generation at or past the
  decision's (any generation for a decision not executed), the latest ``ts`` of the ranks of
  that generation (every rank trains again), the most ``steps_rolled_back``;
* ``ckpt.saved`` / ``ckpt.validated`` — the rollback of an incident whose ``recovery.resumed``
  gives no count nor restored step: the last step before the fault minus the newest checkpoint
  step at or before it.

Figures:

* ``ref_step_s`` — the median seconds per step of the ranks' step advances before the first
  fault (all of them when no fault came), the job's fault-free step time;
* ``useful_steps`` — the newest step reached minus the first step completed (re-done steps
  count once), ``training_goodput`` = ``useful_steps × ref_step_s / wall_s`` (at most 1), where
  ``wall_s`` runs from the first step any rank completed to the last heartbeat: the same window
  as bench/recovery.py's goodput, which starts at the ranks' first step record;
* ``startup_s`` — from the first heartbeat to that first completed step (interpreter, imports,
  rendezvous, the first step itself): reported apart, not counted in ``wall_s`` nor the
  GPU-seconds below;
* per incident, seconds ``detection`` (fault → first anomaly), ``decision`` (anomaly →
  decision), ``restart`` (decision → every rank completed its first step again, less that
  step's ``ref_step_s``, which is useful work), ``rollback`` (re-done steps × ``ref_step_s``),
  and the same × the ranks of the job as GPU-seconds;
* ``gpu_s_other`` — what is neither useful nor an incident's: the step in flight at a fault,
  checkpoint stalls (``gpu_s_total − gpu_s_useful − Σ gpu_s_lost``). Decisions with the same
  ``fault_ts`` (a watchdog escalation) are one incident: its restart ends at the resume of the
  last of them. A decision of action ``none`` (a flag) is no incident.

Source of the split: the recovery timeline of docs/design.md (fault → anomaly → verdict →
decision → action → training again); the goodput definition of bench/recovery.py.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from trainguard import schemas

__all__ = ["IncidentCost", "Ledger", "ledger", "PHASES"]

#: The parts of an incident's lost time, in timeline order.
PHASES = ("detection", "decision", "restart", "rollback")


@dataclass
class IncidentCost:
    """One incident. Times in Unix ns (``resumed_ns`` None: training never resumed, e.g. a
    stop); ``seconds`` / ``gpu_seconds``: phase → s (None where the end is unknown)."""

    decision_id: str
    action: str
    fault_class: str
    generation: int
    fault_ns: int
    detected_ns: int
    decided_ns: int
    resumed_ns: int | None
    world_size: int
    restored_step: int | None
    steps_rolled_back: int
    seconds: dict[str, float | None] = field(default_factory=dict)
    gpu_seconds: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Ledger:
    """A job's ledger; see the module docstring for each figure (seconds, GPU-seconds)."""

    job: str
    start_ns: int = 0
    end_ns: int = 0
    wall_s: float = 0.0
    startup_s: float = 0.0
    world_size: int = 0
    ref_step_s: float | None = None
    first_step: int = -1
    last_step: int = -1
    useful_steps: int = 0
    training_goodput: float | None = None
    gpu_s_total: float = 0.0
    gpu_s_useful: float = 0.0
    gpu_s_lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    gpu_s_other: float = 0.0
    incidents: list[IncidentCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _progress(events: list[schemas.Event]) -> dict[int, list[tuple[int, int]]]:
    """rank → [(Unix ns, step)] in time order, one entry per step value change."""
    per: dict[int, list[tuple[int, int]]] = {}
    for ev in sorted((e for e in events if isinstance(e, schemas.RankHeartbeat)),
                     key=lambda e: e.ts):
        if ev.rank is None:
            continue
        seq = per.setdefault(ev.rank, [])
        t = ev.progress_ts or ev.ts
        if not seq or seq[-1][1] != ev.step:
            seq.append((t, ev.step))
    return per


def _ref_step(per: dict[int, list[tuple[int, int]]], before_ns: int | None) -> float | None:
    rates = []
    for seq in per.values():
        for (t1, s1), (t2, s2) in zip(seq, seq[1:]):
            if s2 > s1 >= 0 and t2 > t1 and (before_ns is None or t2 <= before_ns):
                rates.append((t2 - t1) / 1e9 / (s2 - s1))
    return statistics.median(rates) if rates else None


def _last_step_before(per: dict[int, list[tuple[int, int]]], t_ns: int) -> int | None:
    steps = [s for seq in per.values() for t, s in seq if t <= t_ns]
    return max(steps) if steps else None


def ledger(events: Iterable[schemas.Event], job: str = "") -> Ledger:
    """The ledger of ``job``'s ``events`` (see the module docstring); events of other jobs are
    skipped when ``job`` is given, else the first job seen is taken."""
    evs = [e for e in events if (not job or e.job == job)]
    if not job:
        job = next((e.job for e in evs if e.job), "")
        evs = [e for e in evs if e.job == job]
    led = Ledger(job)
    per = _progress(evs)
    hbs = [e for e in evs if isinstance(e, schemas.RankHeartbeat)]
    if hbs:
        first_hb, led.end_ns = min(e.ts for e in hbs), max(e.ts for e in hbs)
        led.world_size = max(len(per), max(e.world_size for e in hbs))
        steps = [s for seq in per.values() for _, s in seq]
        led.first_step, led.last_step = min(steps), max(steps)
        # the window opens at the first step any rank completed (start-up before it is
        # ``startup_s``, not training time): the steps after it are the useful ones
        done = [(t, s) for seq in per.values() for t, s in seq if s > led.first_step]
        t0, s0 = min(done) if done else (first_hb, led.first_step)
        led.start_ns = min(t0, led.end_ns)
        led.startup_s = max(0.0, (led.start_ns - first_hb) / 1e9)
        led.wall_s = (led.end_ns - led.start_ns) / 1e9
        led.useful_steps = max(0, led.last_step - s0)
    decisions = sorted((e for e in evs if isinstance(e, schemas.Decision)
                        and e.action != "none"), key=lambda e: e.ts)
    first_fault = min((d.fault_ts or d.ts for d in decisions), default=None)
    led.ref_step_s = _ref_step(per, first_fault) or _ref_step(per, None)
    ref = led.ref_step_s or 0.0
    led.gpu_s_total = led.wall_s * led.world_size
    led.gpu_s_useful = led.useful_steps * ref * led.world_size
    if led.wall_s > 0 and led.ref_step_s:
        led.training_goodput = round(min(1.0, led.useful_steps * ref / led.wall_s), 4)
    resumed = sorted((e for e in evs if isinstance(e, schemas.TrainingResumed)),
                     key=lambda e: e.ts)
    ckpts = sorted((e.ts, e.step) for e in evs
                   if isinstance(e, (schemas.CheckpointSaved, schemas.CheckpointValidated)))
    groups: list[list[schemas.Decision]] = []
    for d in decisions:
        if groups and d.fault_ts and groups[-1][0].fault_ts == d.fault_ts:
            groups[-1].append(d)
        else:
            groups.append([d])
    for group in groups:
        inc = _incident(group, resumed, ckpts, per, ref, led.world_size)
        led.incidents.append(inc)
        for p in PHASES:
            led.gpu_s_lost[p] += inc.gpu_seconds.get(p) or 0.0
    led.gpu_s_lost = {p: round(v, 6) for p, v in led.gpu_s_lost.items()}
    led.gpu_s_other = round(led.gpu_s_total - led.gpu_s_useful - sum(led.gpu_s_lost.values()),
                            6)
    return led


def _incident(group: list[schemas.Decision], resumed: list[schemas.TrainingResumed],
              ckpts: list[tuple[int, int]], per: dict[int, list[tuple[int, int]]],
              ref_s: float, job_world: int) -> IncidentCost:
    first, last = group[0], group[-1]
    fault = first.fault_ts or first.detected_ts or first.ts
    detected = first.detected_ts or first.ts
    back = [r for r in resumed if r.ts >= last.ts
            and (not last.execute or r.generation >= last.generation)]
    resumed_ns, restored, rolled = None, None, 0
    if back:
        gen = back[0].generation
        same = [r for r in back if r.generation == gen]
        resumed_ns = max(r.ts for r in same)
        restored = min(r.restored_step for r in same)
        rolled = max(r.steps_rolled_back for r in same)
    if back and not rolled:
        before = _last_step_before(per, fault)
        if restored is None or restored < 0:  # the resume did not say: the newest checkpoint
            saved = [s for t, s in ckpts if t <= fault]
            restored = max(saved) if saved else restored
        if before is not None and restored is not None and restored >= 0:
            rolled = max(0, before - restored)
    world = job_world or first.world_size
    secs: dict[str, float | None] = {
        "detection": max(0.0, (detected - fault) / 1e9),
        "decision": max(0.0, (first.ts - detected) / 1e9),
        # the resume is the first step completed after the restore: that step's own time is
        # useful work (it counts in useful_steps), the rest of the wait is the restart
        "restart": None if resumed_ns is None else max(0.0, (resumed_ns - first.ts) / 1e9
                                                       - ref_s),
        "rollback": rolled * ref_s if resumed_ns is not None else None}
    return IncidentCost(
        decision_id=last.event_id, action=last.action, fault_class=first.fault_class,
        generation=last.generation, fault_ns=fault, detected_ns=detected, decided_ns=first.ts,
        resumed_ns=resumed_ns, world_size=world, restored_step=restored,
        steps_rolled_back=rolled,
        seconds={k: None if v is None else round(v, 6) for k, v in secs.items()},
        gpu_seconds={k: None if v is None else round(v * world, 6) for k, v in secs.items()})
