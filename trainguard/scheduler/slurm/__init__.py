"""Slurm: the pure commands, the controller and the allocation watcher."""
