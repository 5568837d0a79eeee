"""``python -m trainguard.attributor --nats-url URL --redis-url URL``: run the attributor service."""
from trainguard.service import main

from .service import factory

if __name__ == "__main__":
    main(factory)
