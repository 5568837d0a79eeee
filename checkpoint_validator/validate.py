"""The validator's rule: ``validate_checkpoint`` and its ``Report``.

The check itself lives in ``trainguard.checkpoint.verify``, beside the format it reads, so that
the rank-side restore and this service judge a checkpoint by one rule while the rank-side
library imports nothing of the service. This module is the name the service and its callers
have always used.
"""
from __future__ import annotations

from trainguard.checkpoint.verify import Report, validate_checkpoint

__all__ = ["Report", "validate_checkpoint"]
