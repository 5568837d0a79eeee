"""How a verdict becomes a plan: the steps ``remediator.policy.decide`` runs. Pure.

The table's action for a verdict (``table_action``: the rule, the cross-job facts, migrations),
the escalation checks after it (retry budget, loops: ``CHECKS``), the plan that turns an action
into a decision for a new world (``plan``), the pod restarts of a node controller
(``pod_restart``) and the watchdog's next step (``escalate``). The tables they read are
``remediator.policy_table``'s; what each means is ``remediator.policy``'s module docstring.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from trainguard.schemas import Decision, JobRecord, Member, Verdict
from trainguard.schemas.vocabulary import (Action, FaultClass, Layer, first_error_line, signature,
                                           stronger)

from trainguard.core.cuda_errors import sticky_error
from trainguard.remediator import progress
from trainguard.remediator.policy_table import CONFIDENCE, DEFAULT_POLICY, RECOVERY_ACTIONS, Migration, Policy, Rule
from trainguard.remediator.world import new_world, nodes_of, ranks_on

A, F, L = Action, FaultClass, Layer


# ---- job state helpers ---------------------------------------------------------------------------
def with_defaults(job: JobRecord, policy: Policy = DEFAULT_POLICY) -> JobRecord:
    """A copy of ``job`` with the policy's defaults for the settings a launch left unset and
    members of its own (the rules below never change the caller's record)."""
    members = [dict(m) for m in job.members]
    return dataclasses.replace(
        job, mode=job.mode or policy.default_mode,
        retry_budget=(job.retry_budget if job.retry_budget is not None
                      else policy.default_retry_budget),
        world_size=job.world_size or len(members), members=members,
        spare_nodes=list(job.spare_nodes))


def _int(v: Any, default: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def fault_step(verdict: Verdict) -> int | None:
    """``detail["step"]`` as int, or None when the attributor did not give the step."""
    step = verdict.detail.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


# ---- the table ---------------------------------------------------------------------------------
def rule_for(fault_class: str, layer: str, policy: Policy = DEFAULT_POLICY) -> Rule:
    """The row for ``(fault_class, layer)``: an exact layer match, else the any-layer row, else
    ``policy.default_rule``."""
    any_layer = None
    for r in policy.table:
        if r.fault_class != fault_class:
            continue
        if r.layer == layer:
            return r
        if r.layer is None and any_layer is None:
            any_layer = r
    return any_layer or policy.default_rule


def _fact(verdict: Verdict, action: str, policy: Policy) -> tuple[str, str] | None:
    """The first fact rule that applies to ``verdict`` and is stronger than ``action``: the
    action and the reason, in words; else None."""
    for f in policy.fact_rules:
        if not verdict.detail.get(f.fact) or not stronger(f.action, action):
            continue
        if _conf(verdict.confidence) < _conf(f.min_confidence):
            continue
        found = verdict.detail[f.fact]
        found = ", ".join(map(str, found)) if isinstance(found, list) else str(found)
        why = (f"{f.fact.replace('_', ' ')} ({found}, {verdict.confidence} confidence): "
               f"{f.source}")
        error = verdict.detail.get(f"{f.fact}_error") or _root_line(verdict)
        return f.action, why + (f"; the error: {error}" if error else "")
    return None


def _root_line(verdict: Verdict) -> str:
    """The error line of the root cause's first ``[root …]`` evidence entry, else the first."""
    for e in verdict.evidence:
        if e.startswith("[root "):
            return first_error_line(e)
    return first_error_line(verdict.evidence[0]) if verdict.evidence else ""


def _conf(c: str) -> int:
    return CONFIDENCE.index(c) if c in CONFIDENCE else 0


# ---- escalation checks (pure predicates; facts for the reason, or None) ------------------------
def _would_loop(v: Verdict, job: JobRecord, fault_gen: int) -> dict[str, Any] | None:
    """The same fault (signature) at the same step as the last one, after a restart. A fault
    without a step counts only for an application exception whose last occurrence had none
    either: a script that fails the same way before its first step (seen: every restart of a
    rank whose script raised at import failed alike until the retry budget was spent)."""
    last, step = job.last_fault, fault_step(v)
    if not last or last.get("step") != step:
        return None
    if step is None and v.fault_class != "app_exception":
        return None
    if last.get("signature") != signature(v):
        return None
    last_gen = _int(last.get("generation"), -1)
    if last_gen >= fault_gen:  # the same incident, not a repeat after a restart
        return None
    # no step: no report named one (start-up, a plain script whose steps trainguard does not
    # see, a traceback only the launcher relayed): said as unknown, not as "before any step"
    return {"fault_class": v.fault_class, "step": step,
            "where": f"at step {step}" if step is not None else
            "at an unknown step (no report of either fault named one)",
            "last_generation": last_gen}


def _budget_spent(v: Verdict, job: JobRecord, fault_gen: int,
                  policy: "Policy") -> dict[str, Any] | None:
    """The retry budget counts stalled restarts (``remediator.progress``), not attempts."""
    used = progress.stalled_restarts(v, job, fault_gen, policy.progress_s)
    if used >= job.retry_budget:
        return {"retries_used": used, "retry_budget": job.retry_budget}
    return None


def _restart_loop(v: Verdict, job: JobRecord, fault_gen: int,
                  policy: "Policy") -> dict[str, Any] | None:
    return progress.loop_facts(v, job, fault_gen, policy.progress_s, policy.loop_restarts)


CHECKS: dict[str, Callable[..., dict[str, Any] | None]] = {
    "would_loop": lambda v, job, fault_gen, policy: _would_loop(v, job, fault_gen),
    "restart_loop": _restart_loop,
    "budget_spent": _budget_spent,
}


# ---- decide ------------------------------------------------------------------------------------


def pod_restart(decision: Decision, verdict: Verdict | None, restarts_pods: bool,
                policy: Policy = DEFAULT_POLICY) -> tuple[list[str], str]:
    """The nodes whose training pod of ``decision.job`` the node controller replaces
    (``restart_pod``) when it carries ``decision`` out, and why, in words.

    A row of ``policy.pod_restarts`` applies when the verdict's root kind and the decision's
    action are its own; its nodes are those of ``verdict.detail[row.fact]`` that the decision
    names. With ``restarts_pods`` False (a controller that cannot recreate pods: local, Slurm)
    no node is returned and the reason says what must happen instead. No row applies: ``([],
    "")`` — e.g. an escalation to a stop, or an exclusion that a repeat-offender fact chose."""
    if verdict is None:
        return [], ""
    kind = verdict.detail.get("root_kind")
    row = next((r for r in policy.pod_restarts
                if r.root_kind == kind and r.action == decision.action), None)
    if row is None:
        return [], ""
    named = verdict.detail.get(row.fact) or []
    nodes = sorted({str(n) for n in named} & set(decision.nodes))
    if not nodes:
        return [], ""
    where = ", ".join(nodes)
    if not restarts_pods:
        return [], f"{kind} on {where}: {row.elsewhere}"
    return nodes, f"{kind} on {where}: {row.source}"


def fault_generation(verdict: Verdict, job: JobRecord) -> int:
    """The generation the fault happened in: the verdict's own when it has one; else, for a
    fault whose first evidence predates the job's last decision (a late verdict of the incident
    that decision handled), that decision's fault generation; else the job's generation."""
    if verdict.generation is not None:
        return verdict.generation
    last = job.last_decision or {}
    if (verdict.first_ts and last.get("fault_generation") is not None
            and verdict.first_ts < _int(last.get("ts"), 0)):
        return _int(last.get("fault_generation"), job.generation)
    return job.generation


def table_action(verdict: Verdict, job: JobRecord,
                 policy: Policy = DEFAULT_POLICY) -> tuple[str, list[str]]:
    """The action the table (with the fact rules, aliases and the spare requirement) gives
    for ``verdict``, before the escalation checks; and the reasons, in words."""
    root_kind = verdict.detail.get("root_kind")
    if verdict.detail.get("severity") == "warning":
        mig = next((m for m in policy.migrations if m.root_kind == root_kind), None)
        if mig is not None:
            return planned_migration(verdict, job, mig)
    rule = rule_for(verdict.fault_class, verdict.layer, policy)
    action, reasons = rule.action, [f"{verdict.fault_class}/{verdict.layer}: {rule.source}"]
    if (verdict.detail.get("severity") == "warning" and action != A.NONE
            and root_kind not in policy.acting_warnings):
        return A.NONE, reasons + [f"a warning ({root_kind}): flagged until an error confirms it"]
    fact = _fact(verdict, action, policy) if rule.overridable else None
    if fact:
        action, why = fact
        reasons.append(why)
    lost = context_lost(verdict, policy) if action == A.RESTART_IN_PROCESS else None
    if lost:
        action = A.RESTART_WORKERS
        reasons.append(f"the CUDA context is lost ({lost}): the rank is respawned, never "
                       f"restarted in process")
    if action in policy.action_aliases:
        reasons.append(f"{action} is carried out as {policy.action_aliases[action]}")
        action = policy.action_aliases[action]
    if action == A.EXCLUDE_NODE_AND_REQUEUE and rule.requires_spare:
        # an optional replacement needs a spare and a culprit (never a stop for want of one)
        if not _spare_left(job, verdict):
            reasons.append(f"no spare node registered: {rule.fallback} (flag only)")
            action = rule.fallback
        elif not (verdict.culprit.nodes or verdict.culprit.ranks):
            reasons.append(f"no culprit rank or node named: {rule.fallback} (flag only)")
            action = rule.fallback
    return action, reasons


def context_lost(verdict: Verdict, policy: Policy = DEFAULT_POLICY) -> str | None:
    """Why ``verdict``'s fault leaves the culprit's CUDA context unusable, or None: its pattern
    is a row of ``policy.context_lost_patterns``, or a line of its evidence quotes a sticky
    CUDA error (``trainguard.core.cuda_errors.STICKY_ERRORS``)."""
    pattern = verdict.detail.get("pattern")
    if pattern in policy.context_lost_patterns:
        return policy.context_lost_patterns[pattern]
    row = next((e for e in map(sticky_error, verdict.evidence) if e is not None), None)
    return f"{row.name} {row.code}: {row.source}" if row is not None else None


def planned_migration(verdict: Verdict, job: JobRecord, mig: Migration) -> tuple[str, list[str]]:
    """The action for a warning of a degrading node (row ``mig`` of ``MIGRATIONS``):
    ``exclude_node_and_requeue`` of its node when a spare node is left to take its ranks and the
    verdict names a node (``plan`` then builds the new world: the spare in the node's place),
    else ``none`` (flagged); and the reasons, in words (the first starts "planned migration")."""
    reasons = [f"planned migration ({verdict.fault_class}/{verdict.layer}, {mig.root_kind}): "
               f"{mig.source}"]
    if not (verdict.culprit.nodes or verdict.culprit.ranks):
        return A.NONE, reasons + ["no culprit node named: none (flag only)"]
    if not _spare_left(job, verdict):
        return A.NONE, reasons + ["no spare node registered: none (flag only)"]
    return A.EXCLUDE_NODE_AND_REQUEUE, reasons + [
        "the node's ranks move to the spare while every rank still trains (state from the "
        "surviving ranks)"]


def _spare_left(job: JobRecord, verdict: Verdict) -> bool:
    members_nodes = {m.get("node") for m in job.members}
    return any(s not in members_nodes and s not in verdict.culprit.nodes for s in job.spare_nodes)


def plan(verdict: Verdict, job: JobRecord, action: str, reasons: list[str], fault_gen: int,
         policy: Policy = DEFAULT_POLICY, key: str | None = None,
         requeues: bool = False) -> Decision:
    """Turn an action into a full decision: escalation checks, culprit ranks/nodes, the new
    world for an exclusion (below ``min_world_size``: a stop, or, when the node controller
    ``requeues`` the job in its scheduler, the exclusion with the world it leaves — none when
    the job ran on the excluded nodes alone — which the survivors do not train at: the scheduler restarts the job at full size on an allocation
    without the nodes, from the newest valid checkpoint), generation and key.
    Used by ``decide`` and by the watchdog (with ``key`` given). ``reasons`` is not changed:
    the decision's reason is a new list of them with what the checks added."""
    reasons = list(reasons)
    if action == A.EXCLUDE_NODE_AND_REQUEUE and job.members:
        present = {m.get("node") for m in job.members}
        named = sorted(set(verdict.culprit.nodes)) or nodes_of(sorted(verdict.culprit.ranks),
                                                                job.members)
        if named and not any(n in present for n in named):
            # e.g. the agent of an excluded node stays silent: a late node_lost is no new fault
            reasons.append(f"node(s) {', '.join(named)} already out of the job: nothing to "
                           f"exclude")
            action = A.NONE
    for esc in policy.escalations:
        if action not in esc.applies_to:
            continue
        facts = CHECKS[esc.check](verdict, job, fault_gen, policy)
        if facts is not None:
            reasons.append(esc.reason.format(**facts))
            action = esc.then
            if verdict.evidence:  # the user reads why in the decision itself
                reasons.append(f"the error: {_root_line(verdict)}")
            break

    ranks = sorted(set(verdict.culprit.ranks))
    nodes = sorted(set(verdict.culprit.nodes))
    members: list[Member] = []
    world = job.world_size
    if action in (A.RESTART_IN_PROCESS, A.RESTART_WORKERS):
        if not ranks:
            if action == A.RESTART_WORKERS and verdict.fault_class == F.NETWORK:
                # a reset with no culprit: no process is known to be bad, and killing every
                # rank would be a full restart;
                # re-forming the group in place is the cheaper layer that survives a transient
                # fault, and a rank that is really gone shows up as a crash or node loss
                action = A.RESTART_IN_PROCESS
                reasons.append("no culprit rank named: re-form the group in place")
            else:
                reasons.append("no culprit rank named: every rank restarts")
            ranks = sorted(int(m["rank"]) for m in job.members) or list(range(job.world_size))
        nodes = nodes_of(ranks, job.members) or nodes
    elif action == A.EXCLUDE_NODE_AND_REQUEUE:
        nodes = nodes or nodes_of(ranks, job.members)
        if job.members:
            nodes = [n for n in nodes if n in {m.get("node") for m in job.members}]
        if not nodes:
            reasons.append("exclusion needs a culprit node and the verdict named none")
            action = A.STOP_JOB_NOTIFY_USER
        else:
            ranks = ranks_on(nodes, job.members)
            members, used = new_world(job.members, nodes, job.spare_nodes, job.nproc_per_node)
            world = len(members)
            if used:
                reasons.append(f"spare node(s) {', '.join(used)} replace {', '.join(nodes)}")
            if world < job.min_world_size:
                reasons.append(f"excluding {', '.join(nodes)} leaves a world of {world} < "
                               f"min_world_size {job.min_world_size}")
                if requeues:
                    reasons.append("the scheduler requeues the job without "
                                   f"{', '.join(nodes)}: it restarts at world "
                                   f"{job.world_size} from the newest valid checkpoint"
                                   + ("" if members else " on another allocation (no node of "
                                                         "the job is left)"))
                else:
                    action, members, world = A.STOP_JOB_NOTIFY_USER, [], job.world_size

    recovering = action in RECOVERY_ACTIONS
    culprit = ",".join(map(str, ranks)) + "|" + ",".join(nodes)
    if action == A.NONE:
        key = key or f"{verdict.job}:g{fault_gen}:none:{verdict.fault_class}:{culprit}"
        generation = job.generation
    else:
        generation = job.generation + 1
        if job.mode != "action":
            # observe mode never bumps the generation: one key per fault and culprit, so each
            # fault still shows the decision it would have had
            key = key or f"{verdict.job}:g{fault_gen}:observe:{verdict.fault_class}:{culprit}"
        key = key or f"{verdict.job}:g{fault_gen}"
    execute = job.mode == "action" and action != A.NONE
    return Decision(
        job=verdict.job, node=verdict.node, trace=verdict.child_trace(),
        action=action, mode=job.mode, execute=execute, generation=generation,
        ranks=ranks, nodes=nodes, members=members, world_size=world,
        idempotency_key=key, reason="; ".join(reasons), verdict_id=verdict.event_id,
        fault_class=verdict.fault_class, fault_ts=verdict.first_ts,
        detected_ts=_int(verdict.detail.get("detected_ts"), 0) or verdict.ts,
        retries_used=job.retries_used + (1 if recovering else 0),
        retry_budget=job.retry_budget,
    )


def escalate(prev: Decision, job_state: JobRecord, why: str,
             policy: Policy = DEFAULT_POLICY) -> Decision | None:
    """The watchdog's next decision after ``prev`` (executed, but training did not resume or an
    executor failed): the next rung of ``policy.watchdog_ladder`` for the same culprit, key
    ``<prev key>:wd``, the job's next generation. None when ``prev`` has no next rung."""
    nxt = policy.watchdog_ladder.get(prev.action)
    if nxt is None or not prev.job:
        return None
    job = with_defaults(job_state, policy)
    culprit_ranks = list(prev.ranks)
    culprit_nodes = list(prev.nodes) or nodes_of(culprit_ranks, job.members)
    synthetic = Verdict(job=prev.job, fault_class=prev.fault_class, layer=L.UNKNOWN,
                        culprit={"ranks": culprit_ranks, "nodes": culprit_nodes},
                        first_ts=prev.fault_ts, generation=prev.generation, trace=prev.child_trace(),
                        detail={"detected_ts": prev.detected_ts},
                        **({"event_id": prev.verdict_id} if prev.verdict_id else {}))
    reasons = [f"watchdog: {prev.action} of generation {prev.generation} {why}: escalating "
               f"to {nxt}"]
    return plan(synthetic, job, nxt, reasons, prev.generation, policy,
                key=f"{prev.idempotency_key}:wd")
