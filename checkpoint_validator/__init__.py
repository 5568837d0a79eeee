"""checkpoint_validator: verifies every saved checkpoint before anyone may resume from it.

``validate.validate_checkpoint`` is the pure check (shared with ``Checkpointer.restore``);
``service.CheckpointValidator`` runs it on every ``ckpt.saved`` event
(``python -m trainguard.checkpoint_validator``).
"""
