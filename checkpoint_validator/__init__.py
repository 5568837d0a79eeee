"""checkpoint_validator: verifies every saved checkpoint before anyone may resume from it.

``validate.validate_checkpoint`` is the pure check (it lives in ``trainguard.checkpoint.verify``,
shared with ``Checkpointer.restore``, which imports nothing of this package);
``service.CheckpointValidator`` runs it on every ``ckpt.saved`` event
(``python -m trainguard.checkpoint_validator``).
"""
