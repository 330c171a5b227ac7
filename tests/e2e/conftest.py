"""Fixtures for end-to-end tests against the loopback dev cluster.

``dev_cluster`` (session scope) builds the binaries once (cached under
``$KVPOOL_CACHE/devcluster``; the first build takes tens of minutes), starts etcd,
kube-apiserver, controller-manager, scheduler and kwok in a temp dir with two fake GPU nodes,
and tears everything down at the end of the session. ``namespace`` gives each test a fresh
namespace; ``pod_agents`` starts a PodAgentHarness that is stopped after the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool_dev.build import BuildError, ensure_built
from kvpool_dev.cluster import ClusterConfig, DevCluster, GpuNodeSpec
from kvpool_dev.podagents import CommandFactory, PodAgentHarness

GPU_NODES = (GpuNodeSpec("gpu-node-0", gpus=8), GpuNodeSpec("gpu-node-1", gpus=8))
_BUILD_ERRORS: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build (or find cached) binaries before any test runs when e2e tests are selected.

    Doing it here rather than in the fixture keeps a first, tens-of-minutes build outside
    pytest-timeout's per-test limit.
    """
    if any(item.get_closest_marker("e2e") for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")

        def log(msg: str) -> None:  # pytest captures stderr; progress goes to the terminal
            if reporter is not None:
                reporter.write_line(f"[dev-cluster build] {msg}")

        try:
            ensure_built(log=log)
        except BuildError as err:  # reported by every e2e test, the rest of the run goes on
            _BUILD_ERRORS.append(str(err))


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """A running cluster; ``.kubeconfig`` is the admin kubeconfig, ``.kubectl()``/``.helm()``
    run the cached tools, ``.api_client()`` gives a kubernetes-client ApiClient."""
    if _BUILD_ERRORS:
        pytest.fail(f"building the dev-cluster binaries failed: {_BUILD_ERRORS[0]}")
    layout = ensure_built()
    state_dir = tmp_path_factory.mktemp("dev-cluster")
    config = ClusterConfig(state_dir=state_dir, gpu_nodes=GPU_NODES, die_with_parent=True)
    cluster = DevCluster(config, layout)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(dev_cluster: DevCluster) -> Iterator[str]:
    """A fresh namespace whose default service account exists (so pods are admitted)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    dev_cluster.kubectl("create", "namespace", name)
    dev_cluster.wait_service_account(name, timeout=30)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def pod_agents(dev_cluster: DevCluster, tmp_path: Path) -> Iterator[Callable[..., PodAgentHarness]]:
    """``pod_agents(command, namespace=..., label_selector=...)`` -> a started harness."""
    started: list[PodAgentHarness] = []

    def start(
        command: CommandFactory, namespace: str | None = None, label_selector: str | None = None
    ) -> PodAgentHarness:
        harness = PodAgentHarness(
            dev_cluster.kubeconfig,
            command,
            log_dir=tmp_path / f"agents-{len(started)}",
            namespace=namespace,
            label_selector=label_selector,
        )
        harness.start()
        started.append(harness)
        return harness

    yield start
    for harness in started:
        harness.stop()
