"""Alerts: a webhook notifier for the decisions a person must hear of — a job stopped, a node
excluded — as Slack-compatible JSON (``{"text": …, "blocks": […]}``; Mattermost, Rocket.Chat
and most chat webhooks take the same).

``python -m trainguard.services.alerts`` (env ``NATS_URL``, ``TG_ALERT_WEBHOOK``): subscribes
``tg.job.*.decision`` and posts one message per alerting decision. The logic is the reducer
``step`` (pure, ``trainguard.core.reducer``): a decision whose action is in ``ALERT_ACTIONS``
becomes a ``Call("webhook", "post", (payload,), wait=False)``, once per idempotency key and
action (a decision delivered twice alerts once); a failed post comes back as a ``Reply`` with
its error and is logged — an alert is never retried in a loop, and never blocks the bus.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from trainguard import schemas
from trainguard.core.reducer import Call, Effect, Input, Log, Received, Reply
from trainguard.services.live_reducer import ReducerService
from trainguard.services.base import ServiceConfig

__all__ = ["ALERT_ACTIONS", "AlertState", "step", "payload", "Webhook", "Alerts", "main"]

#: action → why it alerts (a person acts on each).
ALERT_ACTIONS: dict[str, str] = {
    "stop_job_notify_user": "the job stopped: the retry budget is spent, the fault loops or "
                            "nothing can recover it; a person must look",
    "exclude_node_and_requeue": "a node was taken out of the job: it needs service (a drain, "
                                "a GPU reset, a repair)",
}


@dataclass
class AlertState:
    """``sent``: (idempotency key, action) already alerted; ``posted``/``failed``: counts.
    ``max_keys``: how many keys are remembered (the oldest are forgotten beyond it)."""

    sent: dict[tuple[str, str], None] = field(default_factory=dict)
    posted: int = 0
    failed: int = 0
    max_keys: int = 10000


def payload(d: schemas.Decision) -> dict[str, Any]:
    """The Slack-compatible message of decision ``d``."""
    what = "STOPPED" if d.action == "stop_job_notify_user" else "node excluded"
    where = ", ".join(d.nodes) or "-"
    mode = "executed" if d.execute else f"{d.mode} mode: not executed"
    text = (f"trainguard: job {d.job} {what} ({d.fault_class or 'fault'}; nodes {where}; "
            f"ranks {d.ranks or '-'}; generation {d.generation}; {mode}): {d.reason}")
    return {"text": text, "blocks": [
        {"type": "section", "text": {"type": "mrkdwn", "text": f"*trainguard*: job `{d.job}` "
                                                               f"*{what}*"}},
        {"type": "section", "fields": [
            {"type": "mrkdwn", "text": f"*action*\n{d.action}"},
            {"type": "mrkdwn", "text": f"*fault*\n{d.fault_class or '-'}"},
            {"type": "mrkdwn", "text": f"*nodes*\n{where}"},
            {"type": "mrkdwn", "text": f"*mode*\n{mode}"}]},
        {"type": "context", "elements": [{"type": "mrkdwn", "text": d.reason[:2000] or "-"}]}],
        "trainguard": {"job": d.job, "action": d.action, "decision_id": d.event_id,
                       "idempotency_key": d.idempotency_key, "nodes": d.nodes,
                       "ranks": d.ranks, "generation": d.generation, "execute": d.execute}}


def step(state: AlertState, inp: Input, now: float) -> tuple[AlertState, list[Effect]]:
    """A decision in ``ALERT_ACTIONS`` → one webhook post (see the module docstring)."""
    if isinstance(inp, Reply) and isinstance(inp.tag, tuple) and inp.tag[:1] == ("alert",):
        if inp.error:
            state.failed += 1
            return state, [Log(logging.WARNING, f"alert for {inp.tag[1]} not delivered: "
                                                f"{inp.error}")]
        state.posted += 1
        return state, []
    if not isinstance(inp, Received) or not isinstance(inp.event, schemas.Decision):
        return state, []
    d = inp.event
    if d.action not in ALERT_ACTIONS:
        return state, []
    key = (d.idempotency_key, d.action)
    if key in state.sent:
        return state, []
    state.sent[key] = None
    while len(state.sent) > state.max_keys:
        state.sent.pop(next(iter(state.sent)))
    return state, [Call("webhook", "post", (payload(d),), reply=("alert", d.job), wait=False)]


class WebhookError(RuntimeError):
    """The webhook answered with an error status or could not be reached."""


class Webhook:
    """POSTs JSON to ``url`` (``timeout_s`` per request) from a worker thread."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"alert webhook {url!r}: expected an http(s) URL")
        self.url, self.timeout_s = url, timeout_s

    def _post(self, body: dict[str, Any]) -> int:
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return int(resp.status)
        except OSError as exc:  # URLError, HTTPError (a 4xx/5xx), timeouts
            raise WebhookError(f"POST {self.url}: {exc}") from None

    async def post(self, body: dict[str, Any]) -> int:
        """POST ``body``; returns the HTTP status. Raises ``WebhookError``."""
        return await asyncio.to_thread(self._post, body)


class Alerts(ReducerService[AlertState]):
    """The alert notifier service (``step`` above behind the bus)."""

    name = "alerts"
    topics = ("tg.job.*.decision",)
    uses_state = False

    def __init__(self, config: ServiceConfig | None = None, webhook: str | None = None):
        url = webhook if webhook is not None else os.environ.get("TG_ALERT_WEBHOOK", "")
        if not url:
            raise WebhookError("alerts: no webhook: set TG_ALERT_WEBHOOK (a Slack-compatible "
                               "incoming-webhook URL)")
        try:
            self.webhook = Webhook(url)
        except ValueError as exc:
            raise WebhookError(str(exc)) from None
        super().__init__(config)

    def initial_state(self) -> AlertState:
        return AlertState()

    def step(self, state, inp, now):
        return step(state, inp, now)

    def targets(self) -> dict[str, Any]:
        return {"webhook": self.webhook}

    def health(self) -> dict[str, Any]:
        return {"posted": self.model.posted, "failed": self.model.failed}


def main(argv: list[str] | None = None) -> None:
    from trainguard.services.entry import main as service_main

    try:
        service_main(lambda cfg: Alerts(cfg), argv)
    except WebhookError as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
