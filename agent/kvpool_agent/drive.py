"""Drive a trace through running agents over HTTP, as an inference engine would.

Each trace request becomes one sequence: its blocks turned into tokens (trace block ``h`` ->
tokens ``h*B .. h*B+B-1``), opened through ``PoolClient`` (rendezvous hashing on the leading
blocks, so shared prefixes meet on one agent) and released at once, which commits its full
blocks to the agent's cache. The figures are what the agents answered (reused tokens), so
they measure the deployed pool, routing included, not a simulation of it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool_agent.client import PoolClient, stable_url
from kvpool_agent.config import ConfigError
from kvpool_agent.traces import HitRates, Trace, TraceRequest

AGENT_PORT = 8000
AGENT_NAME_LABEL = "app.kubernetes.io/name=kvpool-agent"


@dataclass
class DriveResult(HitRates):
    """Counts of one replay; hit rates are hits over queries (blocks, or prompt tokens)."""

    trace: str
    requests: int = 0
    failed: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    seconds: float = 0.0
    per_replica: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "failed": self.failed,
            "query_blocks": self.query_blocks,
            "hit_blocks": self.hit_blocks,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "block_hit_rate": self.block_hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "seconds": self.seconds,
            "requests_per_second": self.requests / self.seconds if self.seconds > 0 else 0.0,
            "per_replica": dict(sorted(self.per_replica.items())),
            "errors": self.errors[:10],
        }


def request_tokens(request: TraceRequest, block_size: int) -> list[int]:
    """The token ids standing for a request's prompt blocks."""
    tokens: list[int] = []
    for h in request.hash_ids:
        tokens.extend(range(h * block_size, h * block_size + block_size))
    return tokens


def drive(
    trace: Trace,
    client: PoolClient,
    *,
    rate: float | None = None,
    on_request: Callable[[DriveResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> DriveResult:
    """Replay ``trace`` through ``client``; ``rate`` paces requests per second (None: as fast
    as the agents answer). A request no replica accepts is counted in ``failed`` (and as a
    miss) instead of aborting: during a rolling restart some will be refused."""
    size = trace.block_size
    result = DriveResult(trace=trace.name)
    start = time.monotonic()
    for i, request in enumerate(trace.requests):
        if should_stop is not None and should_stop():
            break
        if rate:
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        result.requests += 1
        result.query_blocks += len(request.hash_ids)
        result.query_tokens += request.input_length
        if request.hash_ids:
            try:
                seq = client.open(request_tokens(request, size), recompute_last_token=False)
                client.release(seq)
            except (RuntimeError, httpx.HTTPError) as err:
                result.failed += 1
                result.errors.append(f"request {i}: {err}")
            else:
                reused = seq.num_reused_tokens // size
                result.hit_blocks += reused
                result.hit_tokens += min(reused * size, request.input_length)
                result.per_replica[seq.replica] += 1
        if on_request is not None:
            on_request(result)
    result.seconds = time.monotonic() - start
    return result


def endpoint_urls(addresses: Iterable[str], port: int = AGENT_PORT) -> list[str]:
    """Base URLs from ``IP``, ``IP:PORT`` or full URLs; raises ConfigError on a bad one."""
    urls = []
    for address in addresses:
        address = address.strip()
        if not address:
            continue
        if "://" not in address:
            host, sep, tail = address.rpartition(":")
            has_port = sep and tail.isdigit() and ":" not in host
            address = f"http://{address}" if has_port else f"http://{address}:{port}"
        try:
            url = httpx.URL(address)
        except httpx.InvalidURL as err:
            raise ConfigError(f"--endpoints: {address!r} is not a valid URL: {err}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"--endpoints: {address!r} is not an http(s) URL with a host")
        urls.append(address.rstrip("/"))
    return urls


@dataclass(frozen=True)
class PoolEndpoints:
    """The agents of a KVCachePool as the API server lists them."""

    urls: list[str]
    """Each Running, Ready pod's name in the ring (``client.stable_url``), sorted."""
    tokens_per_block: int
    token: str | None = None
    """The tenant's token from the pool's ``<pool>-tenant-<tenant>`` Secret (None: no Secret)."""
    addresses: dict[str, str] = field(default_factory=dict)
    """Name -> ``http://<pod IP>:<port>``: where a client outside the cluster's DNS connects."""


def tenant_secret_name(pool: str, tenant: str) -> str:
    """The Secret the operator keeps a generated tenant's token in (key ``token``)."""
    return f"{pool}-tenant-{tenant}"


def pool_endpoints(
    name: str,
    namespace: str,
    kubeconfig: str | None = None,
    port: int = AGENT_PORT,
    tenant: str | None = None,
) -> PoolEndpoints:
    """Running, ready pods of pool ``name`` (its ``status.selector``) by their names in the
    ring, and the token of ``tenant`` when given (read from its Secret with the same
    credentials).

    A client ranks the pods by their stable names, as the pool's agents do for warm handoff
    (``client.stable_url``, the pool's headless Service), and reaches them by pod IP: the dev
    cluster gives pods loopback IPs but no cluster DNS, and a client inside a real cluster
    can do the same.
    """
    import base64

    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    api_client = config.new_client_from_config(config_file=kubeconfig)
    try:
        custom = client.CustomObjectsApi(api_client)
        pool: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
            "kvpool.io", "v1alpha1", namespace, "kvcachepools", name
        )
        selector = (pool.get("status") or {}).get("selector") or (
            f"{AGENT_NAME_LABEL},app.kubernetes.io/instance={name}"
        )
        cache = (pool.get("spec") or {}).get("kvCacheConfig") or {}
        tokens_per_block = int(cache.get("tokensPerBlock", 32))
        core = client.CoreV1Api(api_client)
        pods: Any = core.list_namespaced_pod(namespace, label_selector=selector)
        token = None
        if tenant is not None:
            try:
                secret: Any = core.read_namespaced_secret(
                    tenant_secret_name(name, tenant), namespace
                )
                raw = (secret.data or {}).get("token")
                token = base64.b64decode(raw).decode().strip() if raw else None
            except ApiException as err:
                if err.status != 404:
                    raise
    finally:
        api_client.close()
    addresses = {}
    for pod in pods.items:
        status = pod.status
        if pod.metadata.deletion_timestamp or status is None or status.phase != "Running":
            continue
        ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
        if ready and status.pod_ip:
            stable = stable_url(pod.metadata.name, name, namespace, port)
            addresses[stable] = endpoint_urls([status.pod_ip], port)[0]
    return PoolEndpoints(
        urls=sorted(addresses),
        tokens_per_block=tokens_per_block,
        token=token,
        addresses=addresses,
    )
