"""The real kopf machinery (registry, settings, watch, handlers) against kmock."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from kopf.testing import KopfRunner
from kube_mock import ApplyingEmulator

from kvpool_operator import handlers

POOLS = "kvpool.io/v1alpha1/kvcachepools"


class MockInThread:
    """kmock on its own event loop thread, since KopfRunner runs kopf in another thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.mock: ApplyingEmulator | None = None
        self.url = ""
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),))

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with ApplyingEmulator() as mock, kmock.Server(mock):
            for res in (POOLS, "apps/v1/statefulsets", "v1/configmaps", "v1/services",
                        "policy/v1/poddisruptionbudgets", "v1/pods", "v1/events"):
                mock.resources[res] = {}
            mock.resources[POOLS].kind = "KVCachePool"
            mock.resources[POOLS].namespaced = True
            mock.resources[POOLS].verbs = {"list", "watch", "get", "patch"}
            mock.resources[POOLS].subresources = {"status", "scale"}
            self.mock = mock
            self.url = str(mock.url).rstrip("/")
            self.ready.set()
            await self._stop.wait()

    def __enter__(self) -> MockInThread:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *_: Any) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


@pytest.fixture
def api_server() -> Iterator[MockInThread]:
    with MockInThread() as server:
        yield server


def test_kopf_runs_the_handlers_on_a_new_pool(
    api_server: MockInThread,
    pool_body: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mock = api_server.mock
    assert mock is not None
    key = (kmock.resource(POOLS), "ns1", "demo")
    mock.objects[key] = copy.deepcopy(pool_body)

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "mock",
        "clusters": [{"name": "mock", "cluster": {"server": api_server.url}}],
        "users": [{"name": "mock", "user": {"token": "t"}}],
        "contexts": [{"name": "mock", "context": {"cluster": "mock", "user": "mock"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = kopf.OperatorSettings()
    with KopfRunner(
        ["run", "--standalone", "--all-namespaces"],
        registry=handlers.registry, settings=settings, timeout=30,
    ) as runner:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if mock.object("apps/v1/statefulsets", "ns1", "demo") is not None:
                break
            time.sleep(0.2)
    assert runner.exception is None, runner.output
    sts = mock.object("apps/v1/statefulsets", "ns1", "demo")
    assert sts is not None, runner.output
    assert settings.persistence.finalizer == "kvpool.io/finalizer"
    pool = mock.object(POOLS, "ns1", "demo")
    assert pool is not None
    annotations = pool["metadata"].get("annotations", {})
    assert not [a for a in annotations if a.startswith("kopf.zalando.org")]
    assert pool["status"]["observedGeneration"] == 1
