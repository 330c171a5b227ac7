"""kvpool operator: the KVCachePool CRD and its kopf reconciler.

Modules, one job each:

- ``models``: pydantic models of the custom resource (reusing the agent's config models);
  ``schema`` + ``rules`` + ``crd``: the structural CRD schema with CEL rules, generated from
  them (``kvpool crd``).
- ``children``: pure ``desired_*`` functions building the StatefulSet, headless Service,
  ConfigMap, PodDisruptionBudget and ServiceMonitor of a pool.
- ``kube``: the thin REST layer (server-side apply, status and scale patches, events).
- ``metrics`` + ``autoscaler``: agent metrics into interval figures, and the pure scaling rule.
- ``status``: conditions and the one status writer; ``reconcile``: the idempotent reconcile.
- ``handlers``: kopf registrations that delegate to ``reconcile`` (``kvpool operator``).
"""
