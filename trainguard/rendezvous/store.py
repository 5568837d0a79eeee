"""Rendezvous for trainguard jobs: the store host, the per-generation barrier, and the socket
abort that makes in-process restart fast on gloo.

* The rendezvous store (a torch ``TCPStore``) lives outside the training ranks — in its own
  process (``python -m trainguard.rendezvous.store``), started by ``trainguard up`` or the demo — so
  losing a rank or a whole training node never loses it.
* Each restart generation ``g`` uses its own key prefix ``<job>/g<g>/``; ranks meet at a barrier
  there before forming their process groups, so a group is only formed once every member arrived
  (findings: a new group's ``init_process_group`` otherwise waits for every member anyway, and a
  member still stuck in the old collective delays everyone).
* ``GroupSockets`` records the sockets a process group opened; ``abort()`` shuts the connected
  ones down. Gloo collectives cannot be aborted from another thread (findings), but a peer whose
  socket is shut down sees "Connection closed by peer" within milliseconds, does the same, and the
  failure cascades through the group (measured here: 4 ranks all raised within 4 ms, new group and
  first allreduce 22 ms after the fault).
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from trainguard.rendezvous.endpoint import TLS_SCHEME, parse_endpoint


def unwrap_rank_excepthook() -> None:
    """Remove the traceback hooks ``init_process_group`` stacked on ``sys.excepthook``.

    Each ``init_process_group`` (torch 2.13) wraps the current hook in one that prefixes every
    traceback line with ``[rank<r>]`` of that group: a spare's one-rank warm-up group labelled a
    later rank's traceback ``[rank0]``, and every generation of in-process restarts added a
    label (``[rank2]: [rank0]: …``). Hooks the program installed itself are kept; a torch whose
    wrapper looks different is left alone."""
    hook = sys.excepthook
    while getattr(hook, "__name__", "") == "_distributed_excepthook" and hook.__closure__:
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__))
        if "old_hook" not in cells:
            break
        hook = cells["old_hook"].cell_contents
    sys.excepthook = hook


class RendezvousError(RuntimeError):
    """The barrier or store failed; the message says which generation and who was missing."""


class Superseded(RendezvousError):
    """A newer decision arrived while waiting at the barrier: join its generation instead."""


def connect_store(endpoint: str, timeout_s: float = 60.0):
    """A ``TCPStore`` client of the store host at ``endpoint`` (through this process's
    ``rdzv_gate.Relay`` when ``TG_RDZV_TOKEN`` is set). Raises RendezvousError."""
    import torch.distributed as dist

    from trainguard.rendezvous.gate import relay_for

    try:  # with TG_RDZV_TOKEN (a rank started without trainguard's launcher): via a relay
        host, port = parse_endpoint(relay_for(endpoint))
    except (OSError, ValueError) as exc:  # no relay, or a tls:// store without the token
        raise RendezvousError(f"cannot open a relay to the rendezvous store at {endpoint}: "
                              f"{exc}") from None
    try:
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        raise RendezvousError(f"cannot reach the rendezvous store at {endpoint} ({exc}): start "
                              f"it with `python -m trainguard.rendezvous.store` or `trainguard up`, "
                              f"or set TG_RDZV_ENDPOINT") from None


def _socket_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:
            continue
    return out


@dataclass
class GroupSockets:
    """Sockets opened while process groups were formed (the fds new since ``begin()``)."""

    before: set[int] = field(default_factory=set)
    fds: set[int] = field(default_factory=set)

    def begin(self) -> None:
        self.before = _socket_fds()

    def end(self) -> None:
        self.fds |= _socket_fds() - self.before

    def abort(self) -> int:
        """Shut down every connected socket of the recorded groups (listening sockets are left:
        shutting those down makes gloo's listener abort the process). Returns how many."""
        n = 0
        for fd in list(self.fds):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass
            finally:
                s.close()
        return n

    def clear(self) -> None:
        self.fds.clear()


def barrier(store, job: str, generation: int, rank: int, world_size: int, timeout_s: float,
            superseded: Callable[[], bool] = lambda: False, poll_s: float = 0.002) -> float:
    """Wait until ``world_size`` ranks arrived at generation ``generation``.

    Returns the seconds waited. Raises ``Superseded`` when ``superseded()`` turns True (a newer
    decision came), ``RendezvousError`` after ``timeout_s`` seconds naming how many arrived.
    """
    key = f"{job}/g{generation}/arrived"
    t0 = time.monotonic()
    store.set(f"{job}/g{generation}/rank{rank}", str(os.getpid()))
    n = store.add(key, 1)
    while n < world_size:
        if superseded():
            raise Superseded(f"generation {generation} superseded while waiting")
        if time.monotonic() - t0 > timeout_s:
            raise RendezvousError(f"rendezvous of generation {generation}: {n}/{world_size} "
                                  f"ranks arrived after {timeout_s:.0f}s")
        time.sleep(poll_s)
        n = store.add(key, 0)
    return time.monotonic() - t0


def form_groups(store, job: str, generation: int, rank: int, world_size: int,
                backend: str = "gloo", timeout_s: float = 300.0):
    """Form the default (training) process group and a separate gloo group for checkpoint
    collectives under prefix ``<job>/g<generation>/``. Returns ``(ckpt_group, GroupSockets)``.

    The checkpoint group is separate because DCP async saves on the training group deadlock
    (findings). ``timeout_s`` bounds each collective; in-process restart does not rely on it.
    """
    import torch.distributed as dist

    socks = GroupSockets()
    socks.begin()
    prefix = dist.PrefixStore(f"{job}/g{generation}/pg", store)
    unwrap_rank_excepthook()  # then init_process_group labels tracebacks with this rank only
    dist.init_process_group(backend, store=prefix, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    ckpt_group = dist.new_group(backend="gloo") if world_size > 1 else None
    socks.end()
    return ckpt_group, socks


#: Process groups retired by the last ``destroy_groups`` call, released one call later.
_RETIRED: list = []


def destroy_groups() -> None:
    """Destroy every process group of this process (< 3 ms, findings); never raises.

    The groups are retired rather than dropped: a ``ProcessGroupGloo`` destructor joins its
    worker threads, and a worker that is still releasing a finished collective needs the GIL.
    When the last reference to a group is held by a DDP ``Reducer`` (still alive in the failed
    step's traceback), that reference is dropped with the GIL held and the process deadlocks
    (pytorch/pytorch#56297; seen here: a warm spare stuck for good in ``~ProcessGroupGloo`` →
    ``thread::join`` while its gloo worker waited for the GIL in ``~ThreadLocalState``). Holding
    our own reference until the next generation is torn down — after a garbage collection, so
    the old ``Reducer`` is gone — makes the last reference ours, dropped through the Python
    binding, whose destructor releases the GIL (torch ≥ 2.8, pytorch/pytorch#154976).
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    _RETIRED.clear()
    try:
        if dist.is_initialized():
            try:
                from torch.distributed.distributed_c10d import _world

                _RETIRED.extend(_world.pg_map.keys())
            except Exception:  # noqa: BLE001 - private API: fall back to the default group
                _RETIRED.append(dist.group.WORLD)
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the group may be half-broken after an abort
        pass


# ---- the store host ---------------------------------------------------------------------------
def serve(host: str, port: int, token: str = "", tls_cert: str = "", tls_key: str = "") -> None:
    """Host a TCPStore on ``host:port`` until SIGTERM/SIGINT; prints ``ready ENDPOINT``.
    With ``token``, the store listens on loopback only and ``trainguard.rendezvous.gate.Gate`` on
    ``host:port`` admits only connections that open with it; with ``tls_cert`` and ``tls_key``
    (PEM files) too, the gate serves TLS only (the token never crosses the network in clear)
    and the endpoint printed is ``tls://host:port``. Raises ValueError for TLS without a
    token."""
    import torch.distributed as dist

    if (tls_cert or tls_key) and not token:
        raise ValueError("a TLS rendezvous gate needs a token (TG_RDZV_TOKEN): without one "
                         "there is no gate")
    gate = None
    if token:
        from trainguard.rendezvous.gate import Gate, server_context

        # TCPStore's own listener binds every interface whatever host it is given (seen: the
        # store behind the gate answered a tokenless client on the host's other addresses):
        # it listens on a socket bound here to loopback instead (``master_listen_fd``)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, master_listen_fd=listener.fileno(),
                              timeout=datetime.timedelta(seconds=300))
        ctx = server_context(tls_cert, tls_key) if tls_cert else None
        gate = Gate(host, port, store.port, token, ssl_ctx=ctx).start()
        scheme = TLS_SCHEME if ctx is not None else ""
        print(f"ready {scheme}{host}:{gate.port} (token required)", flush=True)
    else:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        print(f"ready {host}:{store.port}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGINT, lambda *a: stop.append(1))
    while not stop:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.rendezvous.store",
                                description="Host the rendezvous store of trainguard jobs.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--tls-cert", default="", help="PEM certificate: the gate serves TLS only "
                   "(needs TG_RDZV_TOKEN)")
    p.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    args = p.parse_args(argv)
    from trainguard.rendezvous.gate import TOKEN_ENV

    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    # the token comes from the environment (never a command line, which others can read)
    try:
        serve(args.host, args.port, os.environ.get(TOKEN_ENV, ""), args.tls_cert, args.tls_key)
    except ValueError as exc:
        p.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
