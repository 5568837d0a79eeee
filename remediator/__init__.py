"""Remediator: verdict + job state + policy → decision (see ``remediator.policy`` for the table,
``remediator.reducer`` for what the service decides around it — claims, commit, exclusion,
watchdog — and ``remediator.service`` for the service)."""

from trainguard.remediator.policy import DEFAULT_POLICY, Policy, decide, escalate

__all__ = ["DEFAULT_POLICY", "Policy", "decide", "escalate"]
