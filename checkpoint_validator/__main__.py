"""``python -m trainguard.checkpoint_validator --nats-url URL --redis-url URL``."""
from trainguard.checkpoint_validator.service import run

if __name__ == "__main__":
    run()
