"""Transport limits of the HTTP server: body size and time, header time, idle connections.

uvicorn bounds neither the time a client takes to send its headers nor, with a chunked
body, its size; a few hundred half-open connections or one endless body would hold the agent.
``BodyLimits`` reads every request body before the app sees it, refusing it (413) past the
route's size limit, counted chunked or not, and (408) past ``limits.body_timeout_s``.
``HeaderTimeoutProtocol`` closes a connection whose request headers do not arrive within
``limits.header_timeout_s``; idle keep-alive connections close after ``idle_timeout_s``
(uvicorn's own keep-alive timer).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpool_agent.config import LimitsConfig

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_KV_PATH = re.compile(r"^/v1/sequences/[^/]+/kv/")


def body_limit(limits: LimitsConfig, method: str, path: str) -> tuple[int, str]:
    """The largest body a route accepts and the setting that says so."""
    if method == "PUT" and _KV_PATH.match(path):
        return limits.max_payload_bytes, "max_payload_bytes"
    if method == "POST" and path == "/v1/handoff":
        return limits.max_handoff_bytes, "max_handoff_bytes"
    return limits.max_json_body_bytes, "max_json_body_bytes"


class BodyLimits:
    """ASGI middleware: the whole body, within its size and time limits, or a 4xx."""

    def __init__(
        self, app: ASGIApp, limits: LimitsConfig, on_refusal: Callable[[str], None]
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = body_limit(self.limits, scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(
                send,
                413,
                f"body: {declared} bytes is larger than {limit} (limits.{setting})",
                "body_too_large",
            )
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: no task per receive, no yield when data is there
            async with asyncio.timeout_at(loop.time() + self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        reason = f"body: larger than {limit} bytes (limits.{setting})"
                        await self._refuse(send, 413, reason, "body_too_large")
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            reason = (
                f"body: not received within {self.limits.body_timeout_s:g}s (limits.body_timeout_s)"
            )
            await self._refuse(send, 408, reason, "body_timeout")
            return
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, status: int, reason: str, counter: str) -> None:
        self.on_refusal(counter)
        payload = json.dumps({"detail": reason}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections whose headers come too slowly.

    The timer starts when the connection opens and again when a new request on a kept-alive
    connection begins; it stops when the headers are complete.
    """

    header_timeout: float = 10.0

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def header_timeout_protocol(timeout: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class with this agent's header timeout (uvicorn takes a class)."""
    return type("AgentHttpProtocol", (HeaderTimeoutProtocol,), {"header_timeout": timeout})
