"""Remediator: verdict + job state + policy → decision (see ``remediator.policy`` for the table
and ``remediator.service`` for the service)."""
from trainguard.syspath import working_dir_off_path_under_m

working_dir_off_path_under_m()  # `python -m` here: a ./schemas folder must not shadow ours

from .policy import DEFAULT_POLICY, Policy, decide, escalate  # noqa: E402

__all__ = ["DEFAULT_POLICY", "Policy", "decide", "escalate"]
