"""Remediator: verdict + job state + policy → decision (see ``remediator.policy`` for the table,
``remediator.reducer`` for what the service decides around it — claims, commit, exclusion,
watchdog — and ``remediator.service`` for the service)."""

from trainguard.remediator.plan import escalate
from trainguard.remediator.policy import decide
from trainguard.remediator.policy_table import DEFAULT_POLICY, Policy

__all__ = ["DEFAULT_POLICY", "Policy", "decide", "escalate"]
