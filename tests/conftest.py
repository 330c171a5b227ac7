"""Fixtures and helpers shared across test folders (each folder decides whether to use them)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ENGINE_CORES = ("native", "python")
"""The two cores of the cache engine (``kvpool_agent.cache.native``): the cache and replay
folders run every test on each (``engine_core`` in their conftest), but for the tests marked
``python_core``, which look inside the Python core's parts."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``python_core`` test runs on the Python core only: its native variant is deselected
    (not skipped), since it reads parts the compiled core does not have."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        core = callspec.params.get("engine_core") if callspec is not None else None
        (drop if core == "native" and item.get_closest_marker("python_core") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def use_engine_core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Run the requesting test on ``request.param``'s core (``$KVPOOL_CORE``); a test that is
    not parametrized (a ``unittest.TestCase``) keeps the environment's."""
    core = getattr(request, "param", None)
    if core is not None:
        monkeypatch.setenv("KVPOOL_CORE", str(core))
    return core


@pytest.fixture
def single_torch_thread() -> Iterator[None]:
    """Small tensors run fastest single-threaded: on a shared, loaded machine torch's intra-op
    thread pool turns microsecond matmuls into milliseconds of spinning."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class AgentProcess:
    """A real ``kvpool agent`` process on loopback, ready."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def metric(self, sample: str) -> float:
        """The sum over every label set of one sample of ``/metrics`` (e.g.
        ``kvpool_leases_expired_total``); a sample the agent does not export fails the test."""
        return metric_sum(httpx.get(f"{self.url}/metrics", timeout=10).text, sample)


def metric_sum(text: str, sample: str) -> float:
    """The sum of ``sample`` over its label sets in a Prometheus text exposition (0 for a
    family that has no series yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = [f for f in text_string_to_metric_families(text) if sample.startswith(f.name)]
    if not families:
        raise AssertionError(f"{sample} not in /metrics")
    # a labelled family with no series yet is exported without samples: its sum is 0
    return float(sum(s.value for f in families for s in f.samples if s.name == sample))


AGENT_STARTUP_TIMEOUT = 90.0
"""Importing torch on a loaded 2-core machine is slow."""


def start_agent_process(config: Path, port: int, *args: str) -> AgentProcess:
    """Run ``kvpool agent --config CONFIG ARGS`` (its HTTP port is ``port`` on 127.0.0.1)
    until ``/readyz`` answers; an agent that exits or never gets ready fails the test with
    its log."""
    log = config.with_suffix(".log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool_cli", "agent", "--config", str(config), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    agent = AgentProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + AGENT_STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            agent.stop()
            raise AssertionError(f"agent did not get ready:\n{log.read_text()}")
        try:
            if httpx.get(f"{agent.url}/readyz", timeout=1).status_code == 200:
                return agent
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@pytest.fixture(scope="session")
def start_agent() -> Iterator[Callable[..., AgentProcess]]:
    """``start_agent(config, port, *args)``: ``start_agent_process``, and every agent it
    started is stopped at the end of the session at the latest."""
    started: list[AgentProcess] = []

    def start(config: Path, port: int, *args: str) -> AgentProcess:
        agent = start_agent_process(config, port, *args)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
