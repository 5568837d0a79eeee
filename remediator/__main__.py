"""``python -m trainguard.remediator --nats-url URL --redis-url URL`` (or env NATS_URL / REDIS_URL)."""
from trainguard.services.entry import main

from trainguard.remediator.service import Remediator

if __name__ == "__main__":
    main(Remediator)
