"""What a connector is configured with, and how it finds a pool's replicas.

An engine names a pool either by its Kubernetes name (``pool`` and ``namespace``: the
connector resolves the StatefulSet pods' stable DNS names behind the pool's headless Service,
``<pool>-<i>.<pool>.<namespace>.svc``, as the operator creates them), by explicit
``replicas`` (``HOST:PORT`` of each agent's transfer port), or by the Unix socket of an agent
on the same node (``unix_socket``: KV then moves by memory copies through the agent's
arena). The tenant token comes from a file (the ``token`` key of the operator's
``<pool>-tenant-<name>`` Secret, mounted) or an environment variable; it is never part of the
engine's configuration, which vLLM logs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_TRANSFER_PORT = 8100
TOKEN_ENV = "KVPOOL_TOKEN"
DISCOVERY_MISSES = 4
"""Ordinals probed past the last one that resolved (StatefulSet ordinals are dense, but a pod
that is not ready has no DNS record for a moment)."""


class ConnectorConfigError(ValueError):
    """The connector's configuration is unusable (the message names the field)."""


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of an engine that uses a pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        description="KVCachePool name; its replicas are found through the headless Service.",
    )
    namespace: str = Field(
        default_factory=lambda: os.environ.get("POD_NAMESPACE", "default"),
        pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
        description="Namespace of the pool (default: $POD_NAMESPACE, else `default`).",
    )
    cluster_domain: str = Field(
        default="svc",
        description="DNS suffix after the namespace (`svc.cluster.local` also works).",
    )
    port: int = Field(
        default=DEFAULT_TRANSFER_PORT, ge=1, le=65535, description="The agents' transfer port."
    )
    max_replicas: int = Field(
        default=64, ge=1, le=1024, description="Most pod ordinals discovery probes."
    )
    replicas: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Explicit HOST:PORT transfer endpoints (instead of `pool`).",
    )
    unix_socket: str | None = Field(
        default=None,
        min_length=1,
        max_length=107,
        description="The socket of an agent on the same node (its `transfer.unix_socket`, "
        "mounted into the engine's pod); its workers map the agent's arena and copy KV in and "
        "out themselves. Alone: every key goes to that agent. Beside `pool` or `replicas`: the "
        "pool's agent on this node (a pool with `agent.nodeSocket`), found in the ring by its "
        "pod name; the chains that rank to it take the socket, the others the transfer port.",
    )
    token_file: str | None = Field(
        default=None, description=f"File holding the tenant token (else ${TOKEN_ENV})."
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Model id of the key namespace (default: the engine's served model name).",
    )
    lookup_timeout_s: float = Field(
        default=0.5,
        gt=0,
        le=10,
        description="Longest a scheduler lookup or lease waits; past it the answer is 0 hits.",
    )
    transfer_timeout_s: float = Field(
        default=30.0, gt=0, le=600, description="Longest a worker's GET or PUT may take."
    )
    backoff_s: float = Field(
        default=5.0,
        ge=0,
        le=600,
        description="After the pool failed to answer, lookups answer 0 for this long.",
    )
    lease_ttl_s: float = Field(
        default=30.0, gt=0, le=3600, description="Lease of blocks between lookup and load."
    )
    priority: int | None = Field(
        default=None, ge=0, le=100, description="Retention priority of stored blocks."
    )
    checksums: bool = Field(default=False, description="CRC-32 on every transfer.")
    save: bool = Field(default=True, description="Store computed prompt blocks in the pool.")
    save_decode: bool = Field(
        default=False,
        description="Also store blocks filled by generated tokens (a later turn that repeats "
        "the answer hits them).",
    )
    load: bool = Field(default=True, description="Load prompt blocks the pool holds.")
    layerwise: bool = Field(
        default=True,
        description="Load and save layer by layer during the forward pass (false: loads "
        "complete before it starts).",
    )
    load_layer_chunks: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Layer ranges a load is read in (one GET each, in layer order): a layer's "
        "attention waits only for its own range.",
    )
    load_streams: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Layer ranges of a load read at once over the transfer port, each on a "
        "connection of its own; unset: a quarter of the CPUs this process may run on, 1 to 4 "
        "(measured on a 16-core GPU node: 4 at once read 2.65x as fast as 1).",
    )
    max_pending_saves: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Saves queued for the sender thread; past it new saves are dropped.",
    )
    save_coalesce_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="How long the sender waits after a save for more to send with it, back "
        "to back: the agent handles them warm, for less CPU each (a save reaches the pool at "
        "most this much later); 0 sends each at once.",
    )
    refresh_s: float = Field(
        default=30.0, gt=0, le=3600, description="How often discovery re-resolves the pool."
    )

    def streams(self) -> int:
        """``load_streams``, or the default for the CPUs this process may run on."""
        if self.load_streams is not None:
            return self.load_streams
        return min(4, max(1, len(os.sched_getaffinity(0)) // 4))

    @model_validator(mode="after")
    def _one_source(self) -> ConnectorSettings:
        if (self.pool is not None) + (self.replicas is not None) + (
            self.unix_socket is not None
        ) == 0 or (self.pool is not None and self.replicas is not None):
            raise ValueError(
                "set exactly one of `pool` (a KVCachePool name) and `replicas` (HOST:PORT "
                "list), `unix_socket` (a same-node agent's socket) alone, or `unix_socket` "
                "beside either"
            )
        for replica in self.replicas or ():
            host, sep, port = replica.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"replicas: {replica!r} is not HOST:PORT")
        return self

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The settings from an engine's extra config, or ConnectorConfigError naming the
        field and what it accepts."""
        try:
            return cls.model_validate(extra or {})
        except ValidationError as err:
            problems = []
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"]) or "kv_connector_extra_config"
                problems.append(f"{where}: {e['msg']}")
            raise ConnectorConfigError(
                "kv_connector_extra_config: " + "; ".join(problems)
            ) from None

    def token(self) -> str | None:
        """The tenant token: the file's first line, else the environment, else None."""
        if self.token_file is not None:
            try:
                text = Path(self.token_file).read_text().strip()
            except OSError as err:
                raise ConnectorConfigError(f"token_file: cannot read it ({err})") from None
            if not text or any(c.isspace() for c in text):
                raise ConnectorConfigError("token_file: expected one token, no whitespace")
            return text
        return os.environ.get(TOKEN_ENV) or None


REQUEST_PARAMS_KEY = "kvpool"
"""The key of a request's ``kv_transfer_params`` that holds its kvpool settings (other
connectors of a multi-connector read theirs beside it)."""


class RequestParams(BaseModel):
    """One request's ``kv_transfer_params["kvpool"]``: what the pool may do for it. A request
    can only turn the pool off for itself (a prompt that must not be stored, a one-off),
    never on where the engine's settings turned it off."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    load: bool = Field(default=True, description="Look the prompt up and load what the pool holds.")
    save: bool = Field(default=True, description="Store the request's computed blocks.")

    @classmethod
    def of(cls, kv_transfer_params: Any) -> RequestParams:
        """The request's settings (all defaults without any), or ValueError naming the
        field and what it accepts."""
        if not isinstance(kv_transfer_params, dict):
            if kv_transfer_params is None:
                return cls()
            raise ValueError("kv_transfer_params: a JSON object")
        found = kv_transfer_params.get(REQUEST_PARAMS_KEY)
        if found is None:
            return cls()
        try:
            return cls.model_validate(found)
        except ValidationError as err:
            problems = []
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"])
                problems.append(
                    f"kv_transfer_params.{REQUEST_PARAMS_KEY}{'.' + where if where else ''}: "
                    f"{e['msg']}"
                )
            raise ValueError("; ".join(problems)) from None


class Discovery:
    """The pool's replicas, re-resolved every ``refresh_s`` seconds: the first time inline,
    later on a background thread, so that a slow DNS never stalls the engine's scheduler."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._replicas: list[str] = list(settings.replicas or [])
        self._resolved_at: float | None = None
        self._refreshing = threading.Lock()

    def replicas(self) -> list[str]:
        """``HOST:PORT`` of every replica (stable names; empty when none resolves)."""
        s = self.settings
        if s.pool is None:
            return self._replicas
        if self._resolved_at is None:
            self._refresh()
        elif time.monotonic() - self._resolved_at >= s.refresh_s and not self._refreshing.locked():
            threading.Thread(target=self._refresh, name="kvpool-discovery", daemon=True).start()
        return self._replicas

    def _refresh(self) -> None:
        if not self._refreshing.acquire(blocking=False):
            return
        try:
            self._replicas = self._resolve()
            self._resolved_at = time.monotonic()
        finally:
            self._refreshing.release()

    def _resolve(self) -> list[str]:
        s = self.settings
        found: list[str] = []
        misses = 0
        for ordinal in range(s.max_replicas):
            host = f"{s.pool}-{ordinal}.{s.pool}.{s.namespace}.{s.cluster_domain}"
            try:
                socket.getaddrinfo(host, s.port, type=socket.SOCK_STREAM)
            except OSError:
                misses += 1
                if misses >= DISCOVERY_MISSES:
                    break
                continue
            misses = 0
            found.append(f"{host}:{s.port}")
        return found
