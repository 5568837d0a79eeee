"""Remediator: verdict + job state + policy → decision (see ``remediator.policy`` for the table
and ``remediator.service`` for the service)."""

from .policy import DEFAULT_POLICY, Policy, decide, escalate

__all__ = ["DEFAULT_POLICY", "Policy", "decide", "escalate"]
