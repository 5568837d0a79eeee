"""checkpoint_validator: verifies every saved checkpoint before anyone may resume from it.

``validate.validate_checkpoint`` is the pure check (shared with ``Checkpointer.restore``);
``service.CheckpointValidator`` runs it on every ``ckpt.saved`` event
(``python -m checkpoint_validator``).
"""
from trainguard.syspath import working_dir_off_path_under_m

working_dir_off_path_under_m()  # `python -m` here: a ./schemas folder must not shadow ours
