"""``python -m trainguard.scheduler.slurm.watch`` / ``trainguard slurm-watch``: run the Slurm watcher
(``--nats-url``, ``--redis-url`` or env ``NATS_URL``, ``REDIS_URL``; poll period env
``TG_SLURM_POLL_S``; the Slurm clients' configuration as theirs: ``SLURM_CONF``)."""
from __future__ import annotations

from trainguard.services.entry import main as _service_main

from trainguard.scheduler.slurm.watch.service import factory


def main(argv: list[str] | None = None) -> int:
    _service_main(factory, argv)
    return 0


if __name__ == "__main__":
    main()
