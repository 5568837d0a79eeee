"""The remediator reducer's fleet-breaker stage: an executed node-taking decision asks the
breaker (``remediator.breaker``) before its claim; held, it becomes the job's no-node decision
(``remediator.holds``). Pure; returns ``(state, effects)`` like the other stages.

Stages (``Reply`` tags ``(stage, seq, then)``, ``then`` the claim stage that follows:
``claim`` for a verdict's chain, ``wd_claim`` for a watchdog escalation):

1. ``breaker`` — ``StateStore.breaker_view``: the breaker's state and the number of known
   nodes; the pure ``breaker.admit`` gives the new state and the outcome;
2. ``breaker_put`` — the new state written by compare-and-set on its version; another writer
   first (a replica, a person's reset) → read again and step again (up to ``PUT_TRIES``); then
   the transition, if any, is published on ``tg.fleet.breaker`` and written to the breaker's
   trail, a held decision is audited in the job's trail (``type: held``), and the chain goes on
   to its claim with the decision, held or not.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from trainguard.core.reducer import Effect, Log, Publish, Reply, store
from trainguard.schemas import BreakerChanged, Decision, subjects

from trainguard.remediator import breaker as br
from trainguard.remediator import holds
from trainguard.remediator.model import Out, RemediatorState, Work, owner_of, update

#: compare-and-set tries of one decision's breaker write before it is held (fail closed)
PUT_TRIES = 10


def needs_gate(state: RemediatorState, dec: Decision | None) -> bool:
    """Whether ``dec`` asks the breaker: node-taking, naming nodes, breaker on. A decision of an
    observe-mode job (not executed) asks the breaker's shadow (``which``), which holds nothing
    and shows when the breaker would have tripped had the jobs been in action mode."""
    return (dec is not None and dec.action in br.NODE_TAKING and bool(dec.nodes)
            and dec.mode in ("action", "observe") and state.config.breaker.mode != "off")


def _which(dec: Decision) -> str:
    """The breaker a decision asks: ``""`` (executed) or ``"observe"`` (its shadow)."""
    return "" if dec.execute else "observe"


def _cfg(state: RemediatorState, dec: Decision) -> br.BreakerConfig:
    cfg = state.config.breaker
    return cfg if dec.execute else replace(cfg, mode="observe")


def ask(state: RemediatorState, seq: int, then: str) -> Out:
    dec = state.work[seq].decision
    assert dec is not None
    return state, [store("breaker_view", _which(dec), reply=("breaker", seq, then))]


def _claim(dec: Decision, tag: tuple) -> Effect:
    return store("claim", dec.idempotency_key, owner_of(dec), reply=tag)


def on_breaker(state: RemediatorState, seq: int, w: Work, inp: Reply, now: float) -> Out:
    bstate, known = inp.value
    dec = w.decision
    assert dec is not None and dec.job
    then = inp.tag[2]
    if dec.execute:
        state = replace(state, breaker_seen=(bstate, int(known)))
    req = br.Request(dec.job, dec.event_id, str(dec.action), tuple(dec.nodes),
                     inp.wall_ns or dec.ts)
    new, out = br.admit(bstate, req, int(known), _cfg(state, dec))
    if new == bstate:
        return _proceed(state, seq, w, out, then, inp.wall_ns)
    state, w = update(state, seq, gate=(out, new))
    return state, [store("put_breaker", new, bstate.version, _which(dec),
                         reply=("breaker_put", seq, then))]


def on_breaker_put(state: RemediatorState, seq: int, w: Work, inp: Reply, now: float) -> Out:
    out, new = w.gate
    then = inp.tag[2]
    if inp.value is None:  # another writer came first: read again, step again
        if w.tries + 1 >= PUT_TRIES:
            out = br.Outcome(False, "", out.taken, out.limit, out.known,
                             f"the breaker's state kept changing under {PUT_TRIES} writes: "
                             "held rather than let through uncounted")
            return _proceed(state, seq, w, out, then, inp.wall_ns)
        state, w = update(state, seq, tries=w.tries + 1)
        return ask(state, seq, then)
    state, w = update(state, seq, tries=0)
    if w.decision is not None and w.decision.execute:
        state = replace(state, breaker_seen=(replace(new, version=int(inp.value)), out.known))
    return _proceed(state, seq, w, out, then, inp.wall_ns)


def _proceed(state: RemediatorState, seq: int, w: Work, out: br.Outcome, then: str,
             wall_ns: int) -> Out:
    dec = w.decision
    assert dec is not None and w.record is not None and dec.job
    effects: list[Effect] = []
    cfg = state.config.breaker
    shadow = {} if dec.execute else {"observe_jobs": True}
    if out.transition:
        status = "tripped" if out.transition in ("tripped", "held") else "closed"
        ev = BreakerChanged(transition=out.transition, status=status, taken=out.taken,
                            limit=out.limit, known_nodes=out.known, window_s=cfg.window_s,
                            held_action=str(dec.action) if not out.allowed else "",
                            nodes=list(dec.nodes), decision_id=dec.event_id, job=dec.job,
                            reason=out.reason, trace=dec.child_trace(), detail=shadow,
                            **({"ts": wall_ns} if wall_ns else {}))
        effects += [Publish(subjects.FLEET_BREAKER, ev),
                    store("breaker_audit", {"type": out.transition, "job": dec.job,
                                            "decision_id": dec.event_id,
                                            "action": str(dec.action),
                                            "nodes": list(dec.nodes), "taken": out.taken,
                                            "limit": out.limit, "known_nodes": out.known,
                                            "reason": out.reason, "ts": wall_ns, **shadow},
                          wait=False),
                    Log(logging.WARNING, f"fleet breaker {out.transition}"
                                         f"{' (observe-mode jobs)' if shadow else ''}: "
                                         f"{out.reason}")]
        if out.transition in ("would_trip", "would_hold"):  # the decision says it too
            dec = dec.model_copy(update={"reason": f"{dec.reason}; the fleet breaker would "
                                                   f"have held this: {out.reason}"})
            state, w = update(state, seq, decision=dec)
    if not out.allowed:
        held = holds.no_node_decision(dec, w.verdict, w.record, "breaker", out.reason,
                                      state.config.policy)
        state, w = update(state, seq, decision=held)
        effects.append(store("audit", w.job, {
            "type": "held", "decision_id": dec.event_id, "held_action": str(dec.action),
            "nodes": list(dec.nodes), "by": "breaker", "instead": str(held.action),
            "reason": out.reason, "ts": wall_ns}))
        dec = held
    return state, effects + [_claim(dec, (then, seq))]
