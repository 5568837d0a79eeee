"""The one thing the benchmark's jobs add to an ordinary training script: a line per completed
optimizer step, ``<rank> <step> <unix_ns> <pid> <restart count>``, appended by one ``write`` on
an ``O_APPEND`` descriptor (well under ``PIPE_BUF``: lines of concurrent ranks never interleave).
Every figure of ``bench/dropin.py`` is computed from these lines, the same way for every
launcher."""
import os
import time


class Records:
    def __init__(self, path: str, rank: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.rank = rank
        self.pid = os.getpid()
        self.restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def step(self, step: int) -> None:
        if self.fd is not None:
            os.write(self.fd, f"{self.rank} {step} {time.time_ns()} {self.pid} "
                              f"{self.restarts}\n".encode())
