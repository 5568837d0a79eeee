"""The Slurm watcher: scheduler signals of opted-in Slurm jobs as events on the bus.

``python -m trainguard.scheduler.slurm.watch`` (or ``trainguard slurm-watch``) polls ``squeue --json``
and ``sinfo --json`` every ``SlurmWatchConfig.poll_s`` where the Slurm clients work, registers
each job whose comment holds a trainguard directive (``schemas.slurm``) in its job record
(Slurm id, allocation, state, directive), and publishes what changes: ``slurm.job`` on
``tg.job.<job>.slurm`` and ``slurm.node`` on ``tg.node.<node>.slurm``, which the detector turns
into anomalies (``detector.scheduler``). ``snapshot`` reads the two commands' JSON,
``reducer`` decides (pure, table-tested), ``service`` runs the commands and carries the
effects out.
"""
