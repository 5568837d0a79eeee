"""Slurm: the pure commands, the controller (its config, command runner, requeue and
readmission steps) and the allocation watcher."""
