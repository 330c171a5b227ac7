"""Inference-engine connectors: how an engine reads and writes a pool.

``settings.py`` holds what every connector is configured with (which pool, which tenant,
how long it may wait) and how it finds the pool's replicas; ``stats.py`` the counters a
connector keeps; ``vllm/`` vLLM's ``KVConnectorBase_V1`` implementation, imported only by
vLLM (it needs ``vllm`` installed, which the agent never does).
"""
