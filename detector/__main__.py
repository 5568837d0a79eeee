"""``python -m trainguard.detector --nats-url URL --redis-url URL``: run the detector service."""
from trainguard.services.entry import main

from trainguard.detector.service import factory

if __name__ == "__main__":
    main(factory)
