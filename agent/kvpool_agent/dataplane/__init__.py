"""The data plane an inference-engine connector uses: content-addressed blocks (engine keys),
side-effect-free lookup, leases, and a binary transfer protocol on its own port.

``keys`` (the key -> block mapping) and ``protocol`` (frames) are light: the client
(``kvpool_agent.dataplane.client``) imports them without the agent's web stack.
``server`` is the agent side (``TransferServer``). See docs/dataplane.md.
"""
