"""Node controllers behind one interface: local, Slurm, Kubernetes, and the node canary."""
