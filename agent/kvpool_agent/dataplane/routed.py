"""A pool's replicas over the transfer port, and the one on this node through its socket.

An engine on a node that also runs one of its pool's agents (a pool with ``nodeSocket``: the
agent's Unix socket in a host directory) reaches that agent through its arena instead of
TCP. Chains are still routed as every client routes them (``TransferClient.replica_for``,
rendezvous hashing over the pool's stable names), so each chain lives where the rest of the
pool (other engines, warm handoff, the autoscaler's curves) expects it; only the chains that
rank to the local agent take the same-node path. The local agent is matched to its name in
the ring by its pod name (the first DNS label of the name; its AUTH reply gives ``pod``).

Any failure on the socket falls back to the transfer port for that call: the local agent is
a member of the ring there too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import torch

from kvpool_agent.dataplane.client import (
    Geometry,
    Lease,
    PutResult,
    TransferClient,
    TransferConnectionError,
    TransferError,
)
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.shm import ShmClient

SOCKET_ERRORS = (TransferError, TransferConnectionError, OSError)


def ring_member(replicas: Sequence[str], pod: str | None) -> str | None:
    """The replica whose host's first DNS label is ``pod`` (None: no such member)."""
    if not pod:
        return None
    for replica in replicas:
        host = replica.rsplit(":", 1)[0].strip("[]")
        try:
            ipaddress.ip_address(host)
            continue  # an address names no pod
        except ValueError:
            pass
        if host.split(".", 1)[0] == pod:
            return replica
    return None


class RoutedClient:
    """``KVClient`` over ``tcp``'s replicas, with the chains that rank to ``local`` (the
    replica name of the agent behind ``shm``) read and written through ``shm``."""

    def __init__(self, tcp: TransferClient, shm: ShmClient, local: str) -> None:
        if local not in tcp.replicas:
            raise ValueError(f"{local} is not one of the replicas {tcp.replicas}")
        self.tcp = tcp
        self.shm = shm
        self.local = local

    @property
    def replicas(self) -> list[str]:
        return list(self.tcp.replicas)

    def _is_local(self, ns: KeyNamespace, keys: Sequence[bytes]) -> bool:
        return not self.shm.broken and self.tcp.replica_for(ns, keys) == self.local

    def _on_shm(self, lease: Lease) -> bool:
        return lease.replica == self.shm.path

    def geometry(self, replica: str | None = None) -> Geometry:
        if replica == self.shm.path:
            return self.shm.geometry()
        return self.tcp.geometry(replica)

    def lookup(self, ns: KeyNamespace, keys: Sequence[bytes]) -> list[str]:
        if self._is_local(ns, keys):
            try:
                return self.shm.lookup(ns, keys)
            except SOCKET_ERRORS:
                pass
        return self.tcp.lookup(ns, keys)

    def lease(
        self, ns: KeyNamespace, keys: Sequence[bytes], ttl_s: float | None = None
    ) -> Lease | None:
        if self._is_local(ns, keys):
            try:
                return self.shm.lease(ns, keys, ttl_s)
            except SOCKET_ERRORS:
                pass
        return self.tcp.lease(ns, keys, ttl_s)

    def release(self, lease: Lease) -> None:
        if self._on_shm(lease):
            self.shm.release(lease)
        else:
            self.tcp.release(lease)

    def get_into(
        self,
        lease: Lease,
        dst: torch.Tensor | Sequence[torch.Tensor | None],
        *,
        start: int = 0,
        count: int | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        # A lease belongs to the connection that took it: no fallback for its reads.
        client: ShmClient | TransferClient = self.shm if self._on_shm(lease) else self.tcp
        client.get_into(lease, dst, start=start, count=count, layers=layers)

    def put(
        self,
        ns: KeyNamespace,
        keys: Sequence[bytes],
        kv: torch.Tensor | Sequence[torch.Tensor],
        *,
        first: int = 0,
        priority: int | None = None,
    ) -> PutResult:
        if self._is_local(ns, keys) and self.shm.arena is not None:
            try:
                return self.shm.put(ns, keys, kv, first=first, priority=priority)
            except SOCKET_ERRORS:
                pass
        return self.tcp.put(ns, keys, kv, first=first, priority=priority)

    def close(self) -> None:
        self.shm.close()
        self.tcp.close()
