"""kvpool operator: the KVCachePool CRD and its kopf reconciler."""
