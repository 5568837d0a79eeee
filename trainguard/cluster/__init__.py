"""A real cluster on one machine: nodes in network namespaces on a private bridge, the control
plane on the host side, node faults (power-off, partition, slow link), a real Slurm.

``trainguard.cluster.net`` — namespaces, bridge and the node faults; ``trainguard.cluster.slurm``
— slurmctld and one slurmd per node; ``trainguard.cluster.harness`` — the cluster with its
control plane, launches on the nodes, the fault runner and the ranks' step records. Needs
CAP_NET_ADMIN (``net.unavailable_reason()`` says what is missing).
"""
from trainguard.cluster.harness import (Cluster, ClusterConfig, FaultRunner, stop_on_signals,  # noqa: F401
                      training_again)
from trainguard.cluster.net import ClusterNet, NetError, NetUnavailable, unavailable_reason  # noqa: F401

__all__ = ["Cluster", "ClusterConfig", "FaultRunner", "training_again", "stop_on_signals",
           "ClusterNet",
           "NetError", "NetUnavailable", "unavailable_reason"]
