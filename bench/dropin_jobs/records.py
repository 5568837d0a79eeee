"""The one thing the benchmark's jobs add to an ordinary training script: a line per completed
optimizer step, ``<rank> <step> <unix_ns> <pid> <restart count>``, appended by one ``write`` on
an ``O_APPEND`` descriptor (well under ``PIPE_BUF``: lines of concurrent ranks never interleave).
Every figure of ``bench/dropin.py`` is computed from these lines, the same way for every
launcher.

``note_start(module)``, called by a job before it imports its framework, appends
``<rank> <pid> <restart count> <1 when module was already imported, else 0>`` to
``<records>.starts``: whether the process that became the rank found its framework imported."""
import os
import sys
import time


def note_start(module: str) -> None:
    """One line in ``<--records>.starts`` (nothing without ``--records``)."""
    argv = sys.argv
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--records"), "")
    if not path:
        return
    fd = os.open(path + ".starts", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.environ.get('RANK', '0')} {os.getpid()} "
                     f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} "
                     f"{int(module in sys.modules)}\n".encode())
    finally:
        os.close(fd)


class Records:
    """``step(n)`` appends rank's line for step ``n``; then, when ``<path>.raise<rank>`` exists
    (the bench's exception phase), removes it and raises ``RuntimeError``: a Python exception
    in the training loop, the same under every launcher."""

    def __init__(self, path: str, rank: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.path = path
        self.rank = rank
        self.pid = os.getpid()
        self.restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def step(self, step: int) -> None:
        if self.fd is not None:
            os.write(self.fd, f"{self.rank} {step} {time.time_ns()} {self.pid} "
                              f"{self.restarts}\n".encode())
            trigger = f"{self.path}.raise{self.rank}"
            if os.path.exists(trigger):
                os.remove(trigger)
                raise RuntimeError(f"injected exception in rank {self.rank} at step {step}")
