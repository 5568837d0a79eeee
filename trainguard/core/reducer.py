"""Services as reducers: ``step(state, event, now) -> (state, effects)``.

A service's logic is a pure function. It takes its in-memory state, one input event and the
service clock, does no I/O, and returns the new state and a list of effects: what should be
published, claimed, written to the job record or the audit trail.
``trainguard.services.live_reducer.ReducerService`` (the base
of the detector, attributor and remediator) carries the effects out and feeds what they return
back into ``step`` as ``Reply`` events, so the whole outcome of an input (dedup, incident
grouping, fold-or-escalate) is decided by code that a table test drives without a server, that
``run_offline`` replays in virtual time, and that a replica can rebuild from a stream.

Inputs to ``step``:

* ``Received(subject, event, wall_ns)`` — an event from the bus;
* ``Tick(wall_ns)`` — every ``ServiceConfig.tick_s`` seconds;
* ``Reply(tag, value, error, wall_ns)`` — the result of a ``Call`` that asked for one;
* ``Gained(key)`` / ``Released(key)`` — this replica now serves partition ``key`` (a job; its
  events of the relevance window were just stepped again from the stream) / no longer does
  (forget it: another replica serves it now). See ``trainguard.services.membership``;
* ``BusDown(wall_ns)`` / ``BusUp(gap_s, wall_ns)`` — the bus stopped answering this service's
  pings / answers again after ``gap_s`` seconds: what was not heard meanwhile says nothing
  about the ranks and nodes (the detector restarts its silence clocks, the remediator moves
  its watchdog deadlines).

``now`` is the service clock in seconds: ``time.monotonic()`` live, the recording's receive
time in a replay. Wall-clock times for event fields come from the inputs' ``wall_ns`` (Unix ns).

Effects:

* ``Publish(subject, event)`` — publish on the bus, the event id as ``Nats-Msg-Id`` (a stream
  keeps one copy of an event a restarted or taking-over replica publishes again);
* ``Call(target, method, args, kwargs, reply, wait)`` — await ``<target>.<method>(*args,
  **kwargs)`` where the service names its targets (``"state"`` is the ``StateStore``; the
  ``"bus"`` the ``Bus``, e.g. ``publish_stored``; the remediator adds ``"controller"``). With ``reply`` set, the result comes back as
  ``Reply(reply, value)`` or, when the call raised, ``Reply(reply, None, error="Type: text")``.
  ``wait=False`` runs the call in the background: later effects and inputs do not wait for it.
* ``Log(level, message)`` — a log line (the service's logger).

In flight: ``in_flight(state)`` names the received events (event ids) whose chain of effects
has not completed yet: one waiting for a ``Reply`` still to come or for a ``Tick`` to try a
failed call again. A durable message carrying one of them (a topic of ``holding_topics``) is
acked only once it leaves that set (``trainguard.services.base``), so a process killed meanwhile gets
it again after its restart and steps it anew; ``step`` must then resume the chain from what the
state store says was done (stable claim owners), and step an input already in flight as nothing.

Ordering: inputs are stepped one at a time, in arrival order; an input's effects run in list
order, and a waited-for ``Reply`` is stepped (with its own effects) before the next effect of
the list. One input and its reply chain are therefore atomic with respect to every other input:
no per-job lock is needed, and a replay re-decides exactly as live.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, TypeVar, Union

from trainguard.schemas import Event



S = TypeVar("S")


# ---- inputs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Received:
    """An event as the bus delivered it. ``wall_ns``: Unix ns at reception."""

    subject: str
    event: Event
    wall_ns: int = 0


@dataclass(frozen=True)
class Tick:
    """The periodic input. ``wall_ns``: Unix ns of the tick."""

    wall_ns: int = 0


@dataclass(frozen=True)
class Reply:
    """What a ``Call`` with ``reply=tag`` returned (``value``) or raised (``error``)."""

    tag: Hashable
    value: Any = None
    error: str | None = None
    wall_ns: int = 0


@dataclass(frozen=True)
class Gained:
    """This replica serves partition ``key`` from now on (its recent events were replayed)."""

    key: str
    wall_ns: int = 0


@dataclass(frozen=True)
class Released:
    """This replica no longer serves partition ``key``: drop what is kept of it."""

    key: str
    wall_ns: int = 0


@dataclass(frozen=True)
class BusDown:
    """The bus stopped answering this service's pings (``ReducerService.bus_probe_s``)."""

    wall_ns: int = 0


@dataclass(frozen=True)
class BusUp:
    """The bus answers again; it was unanswering for ``gap_s`` seconds."""

    gap_s: float
    wall_ns: int = 0


Input = Union[Received, Tick, Reply, Gained, Released, BusDown, BusUp]


# ---- effects ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """Publish ``event`` on ``subject``. ``stored``: in the background, until a JetStream
    stream acknowledged it (``Bus.publish_stored``); ``reply`` then names the ``Reply`` that
    says how it went (value: the stream sequence; error: not stored)."""

    subject: str
    event: Event
    stored: bool = False
    reply: Hashable | None = None


@dataclass(frozen=True)
class Call:
    """Await ``<target>.<method>(*args, **kwargs)``; see the module docstring."""

    target: str
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reply: Hashable | None = None
    wait: bool = True


@dataclass(frozen=True)
class Log:
    level: int
    message: str


Effect = Union[Publish, Call, Log]
Step = Callable[[S, Input, float], "tuple[S, list[Effect]]"]


def store(method: str, *args: Any, reply: Hashable | None = None, wait: bool = True,
          **kwargs: Any) -> Call:
    """Shorthand for a ``Call`` on the state store (``target="state"``)."""
    return Call("state", method, args, kwargs, reply, wait)


def run_offline(step: Step, state: S, inputs: Iterable[tuple[float, Input]],
                replies: Callable[[Call], Any] | None = None,
                ) -> tuple[S, list[Effect]]:
    """Run ``step`` over ``inputs`` (``(now, input)`` pairs, in order) in virtual time, with no
    server: ``Call`` effects are answered by ``replies(call)`` (its return value is the reply's
    value; an exception becomes the reply's error) or, without it, by ``None``. A waited-for
    call's reply is stepped at once, as live; a background call's (``wait=False``) reply is
    stepped after the current input and its chain, before the next input (live it arrives
    whenever the call ends). Returns the final state and every effect, in the order they would
    have been carried out. A stored ``Publish`` with a reply is answered as stored (value 0),
    like a background call. This is how table tests and an offline replay drive a service."""
    out: list[Effect] = []
    later: list[tuple[float, Reply]] = []

    def _answer(eff: Call, wall_ns: int) -> Reply:
        try:
            val, err = (replies(eff) if replies else None), None
        except Exception as exc:  # noqa: BLE001
            val, err = None, f"{type(exc).__name__}: {exc}"
        return Reply(eff.reply, val, err, wall_ns)

    def _run(now: float, inp: Input) -> None:
        nonlocal state
        state, effects = step(state, inp, now)
        for eff in effects:
            out.append(eff)
            if isinstance(eff, Publish) and eff.stored and eff.reply is not None:
                later.append((now, Reply(eff.reply, 0, None, getattr(inp, "wall_ns", 0))))
            elif isinstance(eff, Call) and eff.reply is not None:
                reply = _answer(eff, getattr(inp, "wall_ns", 0))
                if eff.wait:
                    _run(now, reply)
                else:
                    later.append((now, reply))

    for now, inp in inputs:
        _run(now, inp)
        while later:
            _run(*later.pop(0))
    return state, out
