"""kmock's Kubernetes emulator with server-side apply creating missing objects.

kmock stores objects and serves list/watch/get/patch like an API server, but a PATCH to an
absent object is a 404 there; server-side apply creates it. This subclass adds that one
behaviour, so the operator's apply path runs unchanged against the mock.
"""

from __future__ import annotations

from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

APPLY = "application/apply-patch"


@attrs.define(kw_only=True)
class ApplyingEmulator(kmock.KubernetesEmulator):
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        is_apply = request.headers.get("Content-Type", "").startswith(APPLY)
        if (
            is_apply
            and request.action == kmock.action.UPDATE
            and request.resource is not None
            and request.name is not None
        ):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self._objects:
                    self._objects[key] = request.data
                elif self._objects[key].deleted:
                    self._objects[key].create(request.data)
                else:
                    key = None  # type: ignore[assignment]
                if key is not None:
                    raw = self._objects[key].last.raw
                    await self._buses[request.resource].put({"type": "ADDED", "object": raw})
        return await super()._handle(request)

    def object(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object as a plain dict, or None when absent or deleted."""
        key = (kmock.resource(resource), namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return dict(self._objects[key].raw)

    @property
    def requests(self) -> list[rendering.Request]:
        """Every request served so far, in order."""
        return list(self)

    def events(self, namespace: str) -> list[dict[str, Any]]:
        res = kmock.resource("v1/events")
        return [
            dict(obj.raw)
            for (r, ns, _), obj in self._objects.items()
            if r == res and ns == namespace and not obj.deleted
        ]
