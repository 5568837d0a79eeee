"""What runs inside a training process: `trainguard.run` and its Context, the runtime, hooks, checkpoint requests, fault injection, auto-resume."""
