"""``python -m trainguard.attributor --nats-url URL --redis-url URL``: run the attributor service."""
from trainguard.services.entry import main

from trainguard.attributor.service import factory

if __name__ == "__main__":
    main(factory)
