"""Kubernetes as a scheduler for trainguard, through the official async client
(``kubernetes_asyncio``; ``pip install 'trainguard[kubernetes]'``).

* ``api`` — the API calls (nodes, pods, the Eviction API with PodDisruptionBudget backoff) and
  the credentials (kubeconfig, in-cluster service account);
* ``controller`` — the node controller the remediator uses (``TG_NODE_CONTROLLER=kubernetes``):
  cordon, suspect label, eviction of the trainguard pods, restart of one failed pod, readmission
  after a canary;
* ``drain`` — the checkpoint-aware drain handshake (``trainguard.io/drain-requested`` →
  checkpoint → ``trainguard.io/drain-ready`` → eviction), ``python -m trainguard.scheduler.k8s drain``.

Node names are those of the downward API (``spec.nodeName``, env ``TG_NODE``), dots included
(subject tokens encode them: ``trainguard.schemas.subjects.token``).
"""
