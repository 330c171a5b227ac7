"""The HTTP API: authenticate -> parse (pydantic) -> service call -> response.

No cache logic lives here. Every route but ``/healthz``, ``/readyz`` and ``/metrics`` takes
``Authorization: Bearer TOKEN`` when the agent has credentials (``kvpool_agent.credentials``):
a tenant's token for sequences, KV and attention, the pool's peer token for ``/v1/handoff``,
``/v1/handback`` and ``/v1/events``. Errors are 4xx (5xx only for "not now": draining or no
free blocks) with ``{"detail": reason}``; a refused request changes nothing. The OpenAPI spec
is served at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool_agent.cache import CacheError
from kvpool_agent.credentials import AuthError, Principal
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.server.events import decode_batch
from kvpool_agent.server.limits import BodyLimits
from kvpool_agent.server.metrics import AgentMetrics
from kvpool_agent.server.models import (
    AppendTokensRequest,
    AttentionRequest,
    AttentionResponse,
    ErrorResponse,
    HandoffResponse,
    KeyNamespaceBody,
    KeysLookupRequest,
    KeysLookupResponse,
    LeaseRequest,
    LeaseResponse,
    OpenSequenceRequest,
    ReplayedBatch,
    SequenceResponse,
    StatsResponse,
)
from kvpool_agent.server.payload import MEDIA_TYPE, PayloadError, decode_tensor, encode_tensor
from kvpool_agent.server.rebalance import HandbackRequest, export_owned
from kvpool_agent.server.service import (
    HEAVY_BYTES,
    AgentService,
    OpenSequence,
    RequestError,
    engine_status,
)
from kvpool_agent.server.snapshot import SnapshotError, SnapshotGeometryError

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}

_bearer = HTTPBearer(auto_error=False, description="A tenant's token, or the pool's peer token.")


async def _authenticated(request: Request, _: Annotated[Any, Security(_bearer)]) -> Principal:
    """The caller's principal, from its bearer token (401 without a valid one)."""
    service: AgentService = request.app.state.service
    try:
        return service.credentials.authenticate(request.headers.get("authorization"))
    except AuthError as err:
        service.refusals["unauthenticated"] += 1
        raise RequestError(err.status, err.reason, {"www-authenticate": "Bearer"}) from None


async def _peer(
    request: Request, principal: Annotated[Principal, Depends(_authenticated)]
) -> Principal:
    """The caller, who must hold the pool's peer token (403 otherwise)."""
    if not principal.peer:
        request.app.state.service.refusals["forbidden"] += 1
        raise RequestError(403, "authorization: this route takes the pool's peer token")
    return principal


Caller = Annotated[Principal, Depends(_authenticated)]
Peer = Annotated[Principal, Depends(_peer)]


def create_app(
    service: AgentService,
    *,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> FastAPI:
    """The agent's ASGI app. The lifespan starts the service (event sockets) unless the
    caller drives ``service.start()`` itself (tests with an ASGI transport)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not service.serving:
            await service.start()
        if on_startup is not None:
            await on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()
            await service.stop()

    app = FastAPI(
        title="kvpool agent",
        version="1",
        summary="A paged KV cache with prefix reuse, served to inference engines.",
        lifespan=lifespan,
    )
    metrics = AgentMetrics(service)
    app.state.service = service
    app.state.metrics = metrics
    app.add_middleware(
        BodyLimits, limits=service.limits, on_refusal=lambda why: service.refusals.update([why])
    )
    app.add_middleware(_LatencyMiddleware, metrics=metrics)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        headers = err.headers or ({"retry-after": "1"} if err.status == 503 else None)
        return JSONResponse({"detail": err.reason}, status_code=err.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        # Not FastAPI's own handler: it echoes the input back, and answers 500 when that
        # input is not JSON-safe (a non-finite float, undecodable bytes).
        detail = [
            {"type": e["type"], "loc": [str(p) for p in e["loc"]], "msg": e["msg"]}
            for e in err.errors()
        ]
        return JSONResponse({"detail": detail}, 422)

    @app.exception_handler(CacheError)
    async def _cache_error(_: Request, err: CacheError) -> JSONResponse:
        status = engine_status(err)
        headers = {"retry-after": "1"} if status == 503 else None
        return JSONResponse({"detail": str(err)}, status_code=status, headers=headers)

    # ----------------------------------------------------------------- sequences

    @app.post("/v1/sequences", status_code=201, responses=ERRORS, tags=["sequences"])
    async def open_sequence(body: OpenSequenceRequest, caller: Caller) -> SequenceResponse:
        """Open a sequence: reuse the cached prefix, allocate blocks for the rest.

        The blocks live in the caller's tenant namespace (``cache_salt`` subdivides it);
        the returned ``seq_id`` is random and only the same tenant can use it."""
        seq = await service.open(
            caller,
            body.tokens,
            body.cache_salt,
            body.extra_keys,
            body.retention,
            body.recompute_last_token,
        )
        return _sequence(seq)

    @app.get("/v1/sequences/{seq_id}", responses=ERRORS, tags=["sequences"])
    async def get_sequence(seq_id: int, caller: Caller) -> SequenceResponse:
        return _sequence(await service.get(caller, seq_id))

    @app.post("/v1/sequences/{seq_id}/tokens", responses=ERRORS, tags=["sequences"])
    async def append_tokens(
        seq_id: int, body: AppendTokensRequest, caller: Caller
    ) -> SequenceResponse:
        """Append tokens; the KV of every earlier token counts as written."""
        return _sequence(await service.append(caller, seq_id, body.tokens))

    @app.post("/v1/sequences/{seq_id}/commit", responses=ERRORS, tags=["sequences"])
    async def commit(seq_id: int, caller: Caller) -> SequenceResponse:
        """Declare the KV of all tokens written: full blocks become reusable now."""
        return _sequence(await service.commit(caller, seq_id))

    @app.delete("/v1/sequences/{seq_id}", status_code=204, responses=ERRORS, tags=["sequences"])
    async def release(seq_id: int, caller: Caller, discard: bool = False) -> Response:
        """Release; ``discard`` drops blocks whose KV was never written (aborted request)."""
        await service.release(caller, seq_id, discard)
        return Response(status_code=204)

    # ----------------------------------------------------------------- KV payloads

    kv_body = {
        "requestBody": {
            "required": True,
            "content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    }

    @app.put(
        "/v1/sequences/{seq_id}/kv/{pool}/{start}",
        status_code=204,
        responses=ERRORS,
        tags=["kv"],
        openapi_extra=kv_body,
    )
    async def write_kv(
        seq_id: int, pool: int, start: int, request: Request, caller: Caller
    ) -> Response:
        """Write blocks ``start..`` of the sequence's table in ``pool`` from a tensor frame
        ``[layers, blocks, 2, tokens_per_block, kv_heads, head_dim]`` (checksum verified)."""
        kv = await _decode(await request.body())
        await service.write_kv(caller, seq_id, pool, start, kv)
        return Response(status_code=204)

    @app.get(
        "/v1/sequences/{seq_id}/kv/{pool}/{start}",
        responses={**ERRORS, 200: {"content": {MEDIA_TYPE: {}}}},
        response_class=Response,
        tags=["kv"],
    )
    async def read_kv(
        seq_id: int, pool: int, start: int, caller: Caller, count: int = Query(1, ge=1, le=65536)
    ) -> Response:
        """Read ``count`` blocks as a tensor frame."""
        kv = await service.read_kv(caller, seq_id, pool, start, count)
        return Response(encode_tensor(kv), media_type=MEDIA_TYPE)

    @app.post("/v1/attention", responses=ERRORS, tags=["attention"])
    async def attention(body: AttentionRequest, caller: Caller) -> AttentionResponse:
        """Attention of a batch of open sequences' last ``q_lens`` tokens over the cache."""
        try:
            q = decode_tensor(base64.b64decode(body.q, validate=True))
        except (binascii.Error, ValueError) as err:
            raise RequestError(400, f"q: {err}") from None
        out, backend = await service.attention(
            caller, body.seq_ids, body.q_lens, body.layer, body.num_qo_heads, body.causal, q
        )
        return AttentionResponse(
            output=base64.b64encode(encode_tensor(out)).decode(), backend=backend
        )

    # ----------------------------------------------------------------- engine keys

    @app.post("/v1/keys/lookup", responses=ERRORS, tags=["keys"])
    async def lookup_keys(body: KeysLookupRequest, caller: Caller) -> KeysLookupResponse:
        """How many leading blocks of a chain of engine keys the cache holds, and where.

        No side effects: nothing is pinned, touched or counted (docs/dataplane.md)."""
        tiers = await service.lookup_keys(caller, _key_namespace(body.namespace), _hex(body.keys))
        return KeysLookupResponse(count=len(tiers), tiers=tiers)

    @app.post("/v1/leases", status_code=201, responses=ERRORS, tags=["keys"])
    async def lease_keys(body: LeaseRequest, caller: Caller, response: Response) -> LeaseResponse:
        """Pin the leading resident blocks of a chain for at most ``ttl_s`` seconds, for
        reads over the transfer port. 201 with a lease, or 200 and ``lease_id: null`` when
        no block of the chain is resident."""
        ns = _key_namespace(body.namespace)
        lease, tiers = await service.lease_keys(caller, ns, _hex(body.keys), body.ttl_s)
        if lease is None:
            response.status_code = 200
            return LeaseResponse(lease_id=None, count=0, tiers=[], first_block=[], ttl_s=None)
        return LeaseResponse(
            lease_id=lease.public_id,
            count=lease.blocks,
            tiers=tiers,
            first_block=lease.first_blocks,
            ttl_s=lease.ttl_s,
        )

    @app.delete("/v1/leases/{lease_id}", status_code=204, responses=ERRORS, tags=["keys"])
    async def release_lease(lease_id: int, caller: Caller) -> Response:
        """Release a lease (its blocks are unpinned once any read in progress ends)."""
        await service.release_lease(caller, lease_id)
        return Response(status_code=204)

    # ----------------------------------------------------------------- pool

    @app.get("/v1/stats", responses=ERRORS, tags=["pool"])
    async def stats(_: Caller) -> StatsResponse:
        return StatsResponse.model_validate(service.stats_document())

    @app.post(
        "/v1/handoff",
        responses=ERRORS,
        tags=["pool"],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )
    async def receive_handoff(request: Request, _: Peer) -> HandoffResponse:
        """Load the hottest blocks a draining peer of the same pool hands over (peer token)."""
        if service.draining:
            raise RequestError(503, "draining: this agent takes no handoff")
        try:
            result = await service.import_blocks(await request.body())
        except SnapshotError as err:
            status = 409 if isinstance(err, SnapshotGeometryError) else 400
            raise RequestError(status, str(err)) from None
        return HandoffResponse(
            chains=result.chains, blocks_written=result.blocks_written, skipped=result.skipped
        )

    @app.post(
        "/v1/handback",
        responses={
            **ERRORS,
            200: {"content": {"application/octet-stream": {}}},
            204: {"description": "This agent holds no chain the asking agent owns."},
        },
        response_class=Response,
        tags=["pool"],
    )
    async def handback(body: HandbackRequest, _: Peer) -> Response:
        """A starting agent of the pool (peer token) asks for the chains it owns in the ring
        it names: a snapshot of them, as ``/v1/handoff`` takes (``server/rebalance.py``)."""
        if service.draining:
            raise RequestError(503, "draining: this agent hands nothing back")
        blob = await export_owned(service, body)
        if not blob:
            return Response(status_code=204)
        return Response(blob, media_type="application/octet-stream")

    @app.get("/v1/events", responses=ERRORS, tags=["events"])
    async def replay_events(
        _: Peer,
        start_seq: int = Query(0, ge=0),
        limit: int = Query(100, ge=1, description="Most batches returned (bounded by the agent)."),
    ) -> list[ReplayedBatch]:
        """Published KV event batches from ``start_seq`` on (those still in the buffer), at
        most ``limit`` and ``limits.max_replay_batches``. Events name every tenant's token ids,
        so this takes the pool's peer token."""
        out = []
        for seq, payload in service.publisher.replay(start_seq, limit):
            ts, events = decode_batch(payload)
            out.append(ReplayedBatch(seq=seq, ts=ts, events=events))
        return out

    # ----------------------------------------------------------------- probes, metrics

    @app.get("/healthz", response_class=PlainTextResponse, tags=["probes"], responses={503: {}})
    async def healthz() -> Response:
        """Alive unless one engine call has held the engine for twice ``engine_stall_s``
        (then the kubelet restarts the agent)."""
        stalled = service.stalled_for
        if stalled > service.limits.engine_stall_s:
            total = stalled + service.limits.engine_stall_s
            return PlainTextResponse(f"engine stalled for {total:.0f}s", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/readyz", response_class=PlainTextResponse, tags=["probes"], responses={503: {}})
    async def readyz() -> Response:
        if service.ready:
            return PlainTextResponse("ready")
        why = [
            name
            for name, ok in (
                ("not serving", service.serving),
                ("events not bound", service.publisher.bound),
                ("draining", not service.draining),
                ("engine stalled", service.stalled_for < 0),
            )
            if not ok
        ]
        return PlainTextResponse(", ".join(why), status_code=503)

    @app.get("/metrics", response_class=Response, tags=["probes"])
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _key_namespace(body: KeyNamespaceBody) -> KeyNamespace:
    return KeyNamespace(body.model, body.rank, body.layer_group)


def _hex(keys: list[str]) -> list[bytes]:
    return [bytes.fromhex(k) for k in keys]


def _sequence(seq: OpenSequence) -> SequenceResponse:
    handle = seq.handle
    return SequenceResponse(
        seq_id=seq.public_id,
        num_tokens=handle.num_tokens,
        num_reused_tokens=handle.num_reused_tokens,
        block_tables=[list(t) for t in handle.block_tables],
        first_token=list(handle.first_token),
        tokens_per_block=handle.tokens_per_block,
        last_page_len=handle.last_page_len,
    )


async def _decode(body: bytes) -> Any:
    """The tensor of a payload (large ones decoded off the event loop)."""
    try:
        if len(body) > HEAVY_BYTES:
            return await asyncio.to_thread(decode_tensor, body)
        return decode_tensor(body)
    except PayloadError as err:
        raise RequestError(400, str(err)) from None


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _LatencyMiddleware:
    """Times every HTTP request into ``kvpool_request_duration_seconds{route,method}``
    (the route template, so ids do not explode the label set)."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], metrics: AgentMetrics
    ) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            if path != "/metrics":
                self.metrics.request_duration.labels(path, scope["method"]).observe(
                    time.perf_counter() - start
                )
