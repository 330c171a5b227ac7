"""A client of a pool's agents: prefix affinity by rendezvous hashing over the replicas.

Every sequence is routed by the key of its leading ``affinity_blocks`` full blocks (plus its
cache salt): each replica scores ``blake2b(replica, key)`` and the highest score wins. Sequences
that share a prefix therefore land on the same replica, where that prefix is cached; adding a
replica moves to it only the keys it now wins (about 1/n of them) and removing one moves only
the keys it held. With the StatefulSet's stable pod names the ranking is stable across
restarts.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

DEFAULT_AFFINITY_BLOCKS = 4


def affinity_key(
    tokens: Sequence[int],
    tokens_per_block: int,
    affinity_blocks: int,
    cache_salt: str | None = None,
) -> bytes:
    """Digest of the salt and the leading full blocks (at least the first token when the
    prompt is shorter than one block, so short prompts still spread)."""
    n = (
        min(len(tokens), tokens_per_block * affinity_blocks) // tokens_per_block
    ) * tokens_per_block
    head = tokens[: max(n, min(len(tokens), tokens_per_block))]
    h = hashlib.blake2b(digest_size=16)
    h.update((cache_salt or "").encode() + b"\x00")
    h.update(struct.pack(f"<{len(head)}Q", *head))
    return h.digest()


def stable_url(pod: str, service: str, namespace: str, port: int) -> str:
    """A StatefulSet pod's name in the ring: its DNS name behind the pool's headless Service.

    Clients and agents rank these names, not pod IPs, so a pod that comes back under the same
    name (a rolling restart) owns the same prefixes, and a chain handed to it stays where the
    clients look for it."""
    return f"http://{pod}.{service}.{namespace}.svc:{port}"


def rendezvous_rank(key: bytes, replicas: Iterable[str]) -> list[str]:
    """Replicas from most to least preferred for ``key`` (highest random weight first)."""

    def score(replica: str) -> int:
        digest = hashlib.blake2b(key + b"\x00" + replica.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(replicas, key=lambda r: (score(r), r), reverse=True)


@dataclass(frozen=True)
class RemoteSequence:
    """An open sequence and the replica that holds it."""

    replica: str
    seq_id: int
    num_tokens: int
    num_reused_tokens: int
    block_tables: list[list[int]]
    first_token: list[int]
    tokens_per_block: int


class PoolClient:
    """Opens sequences on the replica their prefix maps to; falls over to the next-ranked
    replica when one refuses for now (503: draining or full) or cannot be reached.

    ``token`` is the tenant's bearer token (the ``token`` key of the pool's
    ``<pool>-tenant-<name>`` Secret); without it only an agent without credentials answers.
    ``addresses`` maps a replica's name in the ring to the base URL to reach it at (pod IPs
    behind ``stable_url`` names, for a client outside the cluster's DNS); a name without an
    address is its own URL. Results (``RemoteSequence.replica``) name replicas as ranked.
    """

    def __init__(
        self,
        replicas: Iterable[str],
        *,
        tokens_per_block: int,
        affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS,
        timeout: float = 10.0,
        client: httpx.Client | None = None,
        token: str | None = None,
        addresses: Mapping[str, str] | None = None,
    ) -> None:
        self.replicas = sorted({r.rstrip("/") for r in replicas})
        if not self.replicas:
            raise ValueError("replicas: a pool client needs at least one replica")
        self.addresses = {k.rstrip("/"): v.rstrip("/") for k, v in (addresses or {}).items()}
        self.tokens_per_block = tokens_per_block
        self.affinity_blocks = affinity_blocks
        self.http = client if client is not None else httpx.Client(timeout=timeout)
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def add_replica(self, url: str, address: str | None = None) -> None:
        """Rank ``url`` too (reached at ``address`` when given)."""
        name = url.rstrip("/")
        if name not in self.replicas:
            self.replicas = sorted([*self.replicas, name])
        if address is not None:
            self.addresses[name] = address.rstrip("/")

    def remove_replica(self, url: str) -> None:
        name = url.rstrip("/")
        self.replicas = [r for r in self.replicas if r != name]
        self.addresses.pop(name, None)

    def url(self, replica: str) -> str:
        """Where to send a request for ``replica`` (a name in the ring)."""
        return self.addresses.get(replica, replica)

    def ranking(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[str]:
        key = affinity_key(tokens, self.tokens_per_block, self.affinity_blocks, cache_salt)
        return rendezvous_rank(key, self.replicas)

    def replica_for(self, tokens: Sequence[int], cache_salt: str | None = None) -> str:
        return self.ranking(tokens, cache_salt)[0]

    def open(
        self,
        tokens: Sequence[int],
        *,
        cache_salt: str | None = None,
        retention: dict[str, Any] | None = None,
        recompute_last_token: bool = True,
    ) -> RemoteSequence:
        body: dict[str, Any] = {
            "tokens": list(tokens),
            "recompute_last_token": recompute_last_token,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if retention is not None:
            body["retention"] = retention
        last: Exception | None = None
        for replica in self.ranking(tokens, cache_salt):
            try:
                resp = self.http.post(
                    f"{self.url(replica)}/v1/sequences", json=body, headers=self.headers
                )
            except httpx.TransportError as err:
                last = err
                continue
            if resp.status_code == 503:
                last = httpx.HTTPStatusError("unavailable", request=resp.request, response=resp)
                continue
            resp.raise_for_status()
            doc = resp.json()
            return RemoteSequence(
                replica=replica,
                seq_id=doc["seq_id"],
                num_tokens=doc["num_tokens"],
                num_reused_tokens=doc["num_reused_tokens"],
                block_tables=doc["block_tables"],
                first_token=doc["first_token"],
                tokens_per_block=doc["tokens_per_block"],
            )
        raise RuntimeError(f"no replica accepted the sequence: {last}")

    def append(self, seq: RemoteSequence, tokens: Sequence[int]) -> dict[str, Any]:
        resp = self.http.post(
            f"{self.url(seq.replica)}/v1/sequences/{seq.seq_id}/tokens",
            json={"tokens": list(tokens)},
            headers=self.headers,
        )
        resp.raise_for_status()
        doc: dict[str, Any] = resp.json()
        return doc

    def release(self, seq: RemoteSequence, *, discard: bool = False) -> None:
        resp = self.http.delete(
            f"{self.url(seq.replica)}/v1/sequences/{seq.seq_id}",
            params={"discard": str(discard).lower()},
            headers=self.headers,
        )
        resp.raise_for_status()
