"""Ring-aware handoff: blocks go to the agent that the clients will ask for them.

Clients route each sequence by rendezvous hashing of its leading blocks over the pool's
replicas (``kvpool_agent.client``: ``affinity_key`` and ``rendezvous_rank`` over the replica
base URLs, the stable pod names ``http://<pool>-<i>.<pool>.<ns>.svc:8000`` that the operator
also lists as ``lifecycle.handoff_peers``). An agent ranks over the same strings, with the
same function, so it knows, for every chain it holds, which replica the clients send that
chain to, i.e. its *owner*:

- **On drain** (``handoff_by_owner``), the chains go to their owners among the peers that are
  ready now, the draining agent left out (its ``/readyz`` already says 503). On a rolling
  restart that is the peer that takes the chain's traffic while the pod is down; on a scale-in
  it is the survivor that owns the chain under the new ring. Both are what the clients do when
  the replica refuses or disappears: fall over to the next-ranked replica.
- **On start** (``take_back``, before the agent reports ready: the server does not accept
  connections until it is done), the agent asks each ready peer for the chains it owns in the
  full ring (``POST /v1/handback`` with its own URL and the ring it knows), so a restarted
  ordinal gets back what its predecessor handed off, plus what the peers computed for its keys
  while it was down; a new ordinal of a scale-out gets its share too. The peers keep their
  copies (they go cold and are evicted like any block the clients no longer ask for).

Engine-keyed chains (the binary transfer path: their tokens are digests of the engine's keys,
routed by the keys, which the tree does not keep) cannot be routed from the tree: on drain they
go to the first ready peer, as before, and nobody takes them back.

The agent's own name in the ring: ``lifecycle.self_url``, else ``$KVPOOL_SELF_URL``, else the
handoff peer whose host's first DNS label is ``$POD_NAME`` (the operator's pods set it), else
unknown (then nothing is taken back on start; the drain does not need it).

Everything here is best effort: a failure costs warmth, never correctness, and never holds the
agent past its grace period (drain) or ``lifecycle.handback_timeout_s`` (start). Every call
presents the pool's peer token, and ``/v1/handback`` takes only that token.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated

import httpx
from pydantic import BaseModel, ConfigDict, Field

from kvpool_agent.client import affinity_key, rendezvous_rank
from kvpool_agent.config import PEER_URL_PATTERN, LifecycleConfig
from kvpool_agent.dataplane.keys import KEYS_SALT_PREFIX
from kvpool_agent.server.service import SALT_SEP, TENANT_SALT_PREFIX, AgentService
from kvpool_agent.server.snapshot import Namespace, export_by_owner

log = logging.getLogger("kvpool.agent.rebalance")

READY_TIMEOUT_S = 1.0
"""How long a peer's ``/readyz`` may take before the peer counts as not ready."""
MAX_RING = 256
"""Most replicas in a ring (as ``lifecycle.handoff_peers``)."""


def normalize(url: str) -> str:
    """A replica's name as the clients rank it (``PoolClient`` strips a trailing slash)."""
    return url.rstrip("/")


def client_salt(salt: str | None) -> tuple[bool, str | None]:
    """``(routable, the client's cache salt)`` of a namespace's engine salt.

    The agent stores a tenant's blocks under ``<US>tenant<US>NAME[<US>SALT]``
    (``service.tenant_salt``); the clients hash the salt they sent (``SALT`` or none).
    Engine-keyed namespaces are not routable from tokens.
    """
    if salt is not None and salt.startswith(TENANT_SALT_PREFIX):
        _, sep, rest = salt[len(TENANT_SALT_PREFIX) :].partition(SALT_SEP)
        salt = rest if sep else None
    if salt is not None and salt.startswith(KEYS_SALT_PREFIX):
        return False, None
    return True, salt


@dataclass(frozen=True)
class Ring:
    """The replicas a chain may be routed to, and how the clients route."""

    replicas: tuple[str, ...]
    tokens_per_block: int
    affinity_blocks: int

    def owner(self, namespace: Namespace, tokens: list[int]) -> str | None:
        """The replica the clients send a sequence starting with ``tokens`` to (None: an
        engine-keyed chain, or an empty ring)."""
        routable, salt = client_salt(namespace[0])
        if not routable or not self.replicas:
            return None
        key = affinity_key(tokens, self.tokens_per_block, self.affinity_blocks, salt)
        return rendezvous_rank(key, self.replicas)[0]


def self_url(cfg: LifecycleConfig) -> str | None:
    """This agent's name in the ring (see the module docstring); None when unknown."""
    if cfg.self_url:
        return normalize(cfg.self_url)
    env = os.environ.get("KVPOOL_SELF_URL")
    if env:
        return normalize(env)
    pod = os.environ.get("POD_NAME")
    if pod:
        for peer in cfg.handoff_peers:
            host = httpx.URL(peer).host
            if host.split(".", 1)[0] == pod:
                return normalize(peer)
    return None


def peer_headers(service: AgentService, content_type: str) -> dict[str, str]:
    headers = {"content-type": content_type}
    token = service.credentials.peer_token
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return headers


async def ready_peers(peers: Iterable[str], timeout: float) -> list[str]:
    """The peers whose ``/readyz`` answers 200 within ``timeout`` (in the order given)."""
    peers = list(peers)

    async def probe(client: httpx.AsyncClient, peer: str) -> bool:
        try:
            return (await client.get(f"{peer}/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    if not peers or timeout <= 0:
        return []
    async with httpx.AsyncClient(timeout=timeout) as client:
        ok = await asyncio.gather(*(probe(client, p) for p in peers))
    return [p for p, good in zip(peers, ok, strict=True) if good]


@dataclass
class HandoffOutcome:
    """Where a ring-aware drain sent the chains."""

    accepted: dict[str, int] = field(default_factory=dict)
    """Peer -> snapshot bytes it took."""
    failed: int = 0
    """Snapshots no peer took (their chains are lost, or go to the snapshot file)."""

    def describe(self) -> str:
        if not self.accepted:
            return "none"
        return ",".join(sorted(self.accepted))


async def handoff_by_owner(service: AgentService, deadline: float) -> HandoffOutcome:
    """Send each hottest chain to its owner among the ready peers (the drain's step 4)."""
    cfg = service.config.lifecycle
    me = self_url(cfg)
    peers = [p for p in dict.fromkeys(map(normalize, cfg.handoff_peers)) if p != me]
    outcome = HandoffOutcome()
    ready = await ready_peers(peers, min(READY_TIMEOUT_S, deadline - time.monotonic() - 0.1))
    if not ready:
        return outcome
    parts = await _export(service, Ring(tuple(ready), service.engine.tpb, cfg.affinity_blocks))
    headers = peer_headers(service, "application/octet-stream")
    sends = [(ready[0] if who is None else who, blob) for who, blob in parts.items()]

    async def post(client: httpx.AsyncClient, peer: str, blob: bytes) -> bool:
        try:
            resp = await client.post(f"{peer}/v1/handoff", content=blob, headers=headers)
        except httpx.HTTPError as err:
            log.warning("handoff to %s failed: %s", peer, err)
            return False
        if resp.status_code != 200:
            log.warning("handoff to %s refused: %s %s", peer, resp.status_code, resp.text[:200])
            return False
        outcome.accepted[peer] = outcome.accepted.get(peer, 0) + len(blob)
        return True

    remaining = deadline - time.monotonic()
    if remaining <= 0.1:
        outcome.failed = len(sends)
        return outcome
    async with httpx.AsyncClient(timeout=remaining) as client:
        done = await asyncio.gather(*(post(client, peer, blob) for peer, blob in sends))
        for (peer, blob), ok in zip(sends, done, strict=True):
            if ok:
                continue
            # the owner failed: the next peer that took its own share takes this one
            for other in [p for p in outcome.accepted if p != peer]:
                if deadline - time.monotonic() <= 0.1:
                    break
                if await post(client, other, blob):
                    break
            else:
                outcome.failed += 1
    return outcome


class HandbackRequest(BaseModel):
    """``POST /v1/handback``: a starting agent asks for the chains it owns."""

    model_config = ConfigDict(extra="forbid")

    owner: Annotated[str, Field(max_length=512, pattern=PEER_URL_PATTERN)] = Field(
        description="The asking agent's base URL, as the clients rank it."
    )
    replicas: list[Annotated[str, Field(max_length=512, pattern=PEER_URL_PATTERN)]] = Field(
        max_length=MAX_RING,
        description="The ring the chains are ranked over (the owner is added when missing).",
    )


async def export_owned(service: AgentService, request: HandbackRequest) -> bytes:
    """The hottest chains this agent holds that ``request.owner`` owns in the ring
    (empty when none)."""
    cfg = service.config.lifecycle
    owner = normalize(request.owner)
    replicas = tuple(dict.fromkeys([*map(normalize, request.replicas), owner]))
    ring = Ring(replicas, service.engine.tpb, cfg.affinity_blocks)
    return (await _export(service, ring, only=owner)).get(owner, b"")


async def _export(
    service: AgentService, ring: Ring, only: str | None = None
) -> dict[str | None, bytes]:
    """The hottest chains split by their owner in ``ring`` (all owners, or ``only``), off the
    event loop."""
    cfg = service.config.lifecycle
    return await service.call(
        lambda: export_by_owner(
            service.engine,
            service.namespaces,
            ring.owner,
            cfg.affinity_blocks,
            cfg.handoff_max_blocks,
            only=only,
        ),
        heavy=True,
    )


@dataclass
class TakeBackResult:
    """What a starting agent took back from its peers."""

    peers: int = 0
    """Peers that answered."""
    chains: int = 0
    blocks_written: int = 0


async def take_back(service: AgentService) -> TakeBackResult:
    """Ask every ready peer for the chains this agent owns and import them (on start,
    within ``lifecycle.handback_timeout_s``)."""
    cfg = service.config.lifecycle
    result = TakeBackResult()
    me = self_url(cfg)
    if not cfg.ring_aware or cfg.handback_timeout_s <= 0 or me is None:
        return result
    ring = list(dict.fromkeys([*map(normalize, cfg.handoff_peers), me]))[:MAX_RING]
    peers = [p for p in ring if p != me]
    if not peers:
        return result
    deadline = time.monotonic() + cfg.handback_timeout_s
    ready = await ready_peers(peers, min(READY_TIMEOUT_S, cfg.handback_timeout_s))
    if not ready:
        return result
    body = HandbackRequest(owner=me, replicas=ring).model_dump_json()
    headers = peer_headers(service, "application/json")
    limit = service.limits.max_handoff_bytes

    async def fetch(client: httpx.AsyncClient, peer: str) -> bytes | None:
        try:
            async with client.stream(
                "POST", f"{peer}/v1/handback", content=body, headers=headers
            ) as resp:
                if resp.status_code == 204:
                    return b""
                if resp.status_code != 200:
                    log.warning("take back from %s refused: %s", peer, resp.status_code)
                    return None
                chunks, size = [], 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        log.warning("take back from %s: over max_handoff_bytes", peer)
                        return None
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as err:
            log.warning("take back from %s failed: %s", peer, err)
            return None

    async with httpx.AsyncClient(timeout=max(deadline - time.monotonic(), 0.1)) as client:
        try:
            blobs = await asyncio.wait_for(
                asyncio.gather(*(fetch(client, p) for p in ready)),
                timeout=max(deadline - time.monotonic(), 0.1),
            )
        except TimeoutError:
            log.warning("take back: peers did not answer within %.1fs", cfg.handback_timeout_s)
            return result
    for peer, blob in zip(ready, blobs, strict=True):
        if blob is None:
            continue
        result.peers += 1
        if not blob:
            continue
        try:
            imported = await service.import_blocks(blob)
        except Exception as err:  # a bad answer costs warmth, not the start
            log.warning("take back from %s: not loaded: %s", peer, err)
            continue
        result.chains += imported.chains
        result.blocks_written += imported.blocks_written
    log.info(
        "took back %d blocks in %d chains from %d peers",
        result.blocks_written,
        result.chains,
        result.peers,
    )
    return result
