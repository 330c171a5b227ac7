"""The HTTP API: parse (pydantic) -> service call -> response. No cache logic lives here.

Errors are 4xx (5xx only for "not now": draining or no free blocks) with ``{"detail": reason}``;
a refused request changes nothing. The OpenAPI spec is served at ``/openapi.json``.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool_agent.cache import (
    CacheError,
    InvalidRetentionError,
    InvalidTokensError,
    OutOfBlocksError,
    RequestTooLargeError,
    SequenceHandle,
    UnknownSequenceError,
)
from kvpool_agent.server.events import decode_batch
from kvpool_agent.server.metrics import AgentMetrics
from kvpool_agent.server.models import (
    AppendTokensRequest,
    AttentionRequest,
    AttentionResponse,
    ErrorResponse,
    HandoffResponse,
    OpenSequenceRequest,
    ReplayedBatch,
    SequenceResponse,
    StatsResponse,
)
from kvpool_agent.server.payload import MEDIA_TYPE, PayloadError, decode_tensor, encode_tensor
from kvpool_agent.server.service import AgentService, RequestError
from kvpool_agent.server.snapshot import SnapshotError

ENGINE_STATUS: dict[type[CacheError], int] = {
    UnknownSequenceError: 404,
    RequestTooLargeError: 413,
    OutOfBlocksError: 503,
    InvalidTokensError: 422,
    InvalidRetentionError: 422,
}

MAX_BODY_BYTES = 1 << 30

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 409, 413, 422, 503)
}


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
    app.add_middleware(_LatencyMiddleware, metrics=metrics)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        headers = {"retry-after": "1"} if err.status == 503 else None
        return JSONResponse({"detail": err.reason}, status_code=err.status, headers=headers)

    @app.exception_handler(CacheError)
    async def _cache_error(_: Request, err: CacheError) -> JSONResponse:
        status = next((s for t, s in ENGINE_STATUS.items() if isinstance(err, t)), 400)
        headers = {"retry-after": "1"} if status == 503 else None
        return JSONResponse({"detail": str(err)}, status_code=status, headers=headers)

    # ----------------------------------------------------------------- sequences

    @app.post("/v1/sequences", status_code=201, responses=ERRORS, tags=["sequences"])
    async def open_sequence(body: OpenSequenceRequest) -> SequenceResponse:
        """Open a sequence: reuse the cached prefix, allocate blocks for the rest."""
        handle = await service.open(
            body.tokens,
            body.cache_salt,
            body.extra_keys,
            body.retention,
            body.recompute_last_token,
        )
        return _sequence(handle)

    @app.get("/v1/sequences/{seq_id}", responses=ERRORS, tags=["sequences"])
    async def get_sequence(seq_id: int) -> SequenceResponse:
        return _sequence(service.handle(seq_id))

    @app.post("/v1/sequences/{seq_id}/tokens", responses=ERRORS, tags=["sequences"])
    async def append_tokens(seq_id: int, body: AppendTokensRequest) -> SequenceResponse:
        """Append tokens; the KV of every earlier token counts as written."""
        return _sequence(await service.append(seq_id, body.tokens))

    @app.post("/v1/sequences/{seq_id}/commit", responses=ERRORS, tags=["sequences"])
    async def commit(seq_id: int) -> SequenceResponse:
        """Declare the KV of all tokens written: full blocks become reusable now."""
        return _sequence(await service.commit(seq_id))

    @app.delete("/v1/sequences/{seq_id}", status_code=204, responses=ERRORS, tags=["sequences"])
    async def release(seq_id: int, discard: bool = False) -> Response:
        """Release; ``discard`` drops blocks whose KV was never written (aborted request)."""
        await service.release(seq_id, discard)
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
    async def write_kv(seq_id: int, pool: int, start: int, request: Request) -> Response:
        """Write blocks ``start..`` of the sequence's table in ``pool`` from a tensor frame
        ``[layers, blocks, 2, tokens_per_block, kv_heads, head_dim]`` (checksum verified)."""
        kv = _decode(await _read_body(request))
        await service.write_kv(seq_id, pool, start, kv)
        return Response(status_code=204)

    @app.get(
        "/v1/sequences/{seq_id}/kv/{pool}/{start}",
        responses={**ERRORS, 200: {"content": {MEDIA_TYPE: {}}}},
        response_class=Response,
        tags=["kv"],
    )
    async def read_kv(
        seq_id: int, pool: int, start: int, count: int = Query(1, ge=1, le=65536)
    ) -> Response:
        """Read ``count`` blocks as a tensor frame."""
        kv = await service.read_kv(seq_id, pool, start, count)
        return Response(encode_tensor(kv), media_type=MEDIA_TYPE)

    @app.post("/v1/attention", responses=ERRORS, tags=["attention"])
    async def attention(body: AttentionRequest) -> AttentionResponse:
        """Attention of a batch of open sequences' last ``q_lens`` tokens over the cache."""
        try:
            q = decode_tensor(base64.b64decode(body.q, validate=True))
        except (binascii.Error, ValueError) as err:
            raise RequestError(400, f"q: {err}") from None
        out, backend = await service.attention(
            body.seq_ids, body.q_lens, body.layer, body.num_qo_heads, body.causal, q
        )
        return AttentionResponse(
            output=base64.b64encode(encode_tensor(out)).decode(), backend=backend
        )

    # ----------------------------------------------------------------- pool

    @app.get("/v1/stats", tags=["pool"])
    async def stats() -> StatsResponse:
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
    async def receive_handoff(request: Request) -> HandoffResponse:
        """Load the hottest blocks a draining peer of the same geometry hands over."""
        if service.draining:
            raise RequestError(503, "draining: this agent takes no handoff")
        try:
            result = await service.import_blocks(await _read_body(request))
        except SnapshotError as err:
            raise RequestError(409 if "geometry" in str(err) else 400, str(err)) from None
        return HandoffResponse(
            chains=result.chains, blocks_written=result.blocks_written, skipped=result.skipped
        )

    @app.get("/v1/events", tags=["events"])
    async def replay_events(start_seq: int = Query(0, ge=0)) -> list[ReplayedBatch]:
        """Published KV event batches from ``start_seq`` on (those still in the buffer)."""
        out = []
        for seq, payload in service.publisher.replay(start_seq):
            ts, events = decode_batch(payload)
            out.append(ReplayedBatch(seq=seq, ts=ts, events=events))
        return out

    # ----------------------------------------------------------------- probes, metrics

    @app.get("/healthz", response_class=PlainTextResponse, tags=["probes"])
    async def healthz() -> str:
        return "ok"

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
            )
            if not ok
        ]
        return PlainTextResponse(", ".join(why), status_code=503)

    @app.get("/metrics", response_class=Response, tags=["probes"])
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _sequence(handle: SequenceHandle) -> SequenceResponse:
    return SequenceResponse(
        seq_id=handle.seq_id,
        num_tokens=handle.num_tokens,
        num_reused_tokens=handle.num_reused_tokens,
        block_tables=[list(t) for t in handle.block_tables],
        first_token=list(handle.first_token),
        tokens_per_block=handle.tokens_per_block,
        last_page_len=handle.last_page_len,
    )


def _decode(body: bytes) -> Any:
    try:
        return decode_tensor(body)
    except PayloadError as err:
        raise RequestError(400, str(err)) from None


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"body: larger than {MAX_BODY_BYTES} bytes")
    return await request.body()


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
