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
