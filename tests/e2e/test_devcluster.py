"""The dev cluster behaves like a real cluster: API server, kubectl, helm, the scheduler
binding GPU pods to kwok nodes, the controller-manager running Deployments, server-side
validation, and the pod-agent harness running a real process on each pod's 127.x IP."""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_dev.build import DEFAULT_VERSIONS
from kvpool_dev.cluster import GPU_RESOURCE, DevCluster
from kvpool_dev.podagents import PodAgentHarness, command_template
from kvpool_dev.poll import wait_until

pytestmark = pytest.mark.e2e


def _get_json(cluster: DevCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def _gpu_pod(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {
            "containers": [
                {
                    "name": "agent",
                    "image": "kvpool/agent:dev",
                    "resources": {"limits": {GPU_RESOURCE: str(gpus)}},
                }
            ]
        },
    }


def _apply(cluster: DevCluster, namespace: str, manifest: dict[str, Any]) -> None:
    _kubectl_stdin(cluster, ["apply", "-n", namespace, "-f", "-"], manifest, check=True)


def _kubectl_stdin(
    cluster: DevCluster, args: list[str], manifest: dict[str, Any], check: bool
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.bin_dir / "kubectl"), *args],
        input=yaml.safe_dump(manifest),
        env={**cluster.env(), "HOME": str(cluster.state_dir)},
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )


def _running_pod(cluster: DevCluster, namespace: str, name: str) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        pod = _get_json(cluster, "pod", "-n", namespace, name)
        return pod if pod["status"].get("phase") == "Running" else None

    result: dict[str, Any] = wait_until(f"pod {name} Running", running)
    return result


def test_api_server_answers_with_pinned_version(dev_cluster: DevCluster) -> None:
    from kubernetes import client

    with dev_cluster.api_client() as api:
        info = client.VersionApi(api).get_code()
        assert info.git_version == DEFAULT_VERSIONS.kubernetes
        namespaces = {
            n.metadata.name for n in client.CoreV1Api(api).list_namespace().items if n.metadata
        }
    assert {"default", "kube-system", "kube-node-lease"} <= namespaces


def test_kubectl_talks_to_the_cluster(dev_cluster: DevCluster) -> None:
    version = json.loads(dev_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == DEFAULT_VERSIONS.kubernetes
    assert version["clientVersion"]["gitVersion"] == DEFAULT_VERSIONS.kubernetes
    assert "ok" in dev_cluster.kubectl("get", "--raw", "/readyz").stdout


def test_kwok_gpu_nodes_are_ready_with_gpu_capacity(dev_cluster: DevCluster) -> None:
    nodes = _get_json(dev_cluster, "nodes")["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert {"gpu-node-0", "gpu-node-1"} <= set(by_name)
    for node in (by_name["gpu-node-0"], by_name["gpu-node-1"]):
        assert node["status"]["capacity"][GPU_RESOURCE] == "8"
        assert node["status"]["allocatable"][GPU_RESOURCE] == "8"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("kwok-")


def test_scheduler_binds_gpu_pod_which_runs_with_loopback_ip(
    dev_cluster: DevCluster, namespace: str
) -> None:
    _apply(dev_cluster, namespace, _gpu_pod("fits", gpus=4))
    pod = _running_pod(dev_cluster, namespace, "fits")
    assert pod["spec"]["nodeName"] in {"gpu-node-0", "gpu-node-1"}
    ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert ip in ipaddress.ip_network(dev_cluster.pod_cidr)
    assert ip.is_loopback

    # No node has 9 GPUs: the real scheduler must keep this pod Pending as Unschedulable.
    _apply(dev_cluster, namespace, _gpu_pod("too-big", gpus=9))

    def unschedulable() -> bool:
        pod = _get_json(dev_cluster, "pod", "-n", namespace, "too-big")
        conds = pod["status"].get("conditions", [])
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds
        )

    wait_until("too-big to be Unschedulable", unschedulable)
    pod = _get_json(dev_cluster, "pod", "-n", namespace, "too-big")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_deployment_pods_come_from_controller_manager(
    dev_cluster: DevCluster, namespace: str
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "nginx"}]},
            },
        },
    }
    _apply(dev_cluster, namespace, deployment)

    def available() -> bool:
        dep = _get_json(dev_cluster, "deployment", "-n", namespace, "web")
        return dep.get("status", {}).get("availableReplicas") == 3

    wait_until("deployment web available", available)
    pods = _get_json(dev_cluster, "pods", "-n", namespace, "-l", "app=web")["items"]
    assert len(pods) == 3
    for pod in pods:
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "ReplicaSet"
        assert pod["status"]["phase"] == "Running"


def test_pod_ips_are_unique_across_nodes(dev_cluster: DevCluster, namespace: str) -> None:
    # 6 one-GPU pods spread over both nodes; every agent needs an address of its own.
    for i in range(6):
        _apply(dev_cluster, namespace, _gpu_pod(f"p{i}", gpus=1, labels={"app": "spread"}))

    def all_running() -> list[dict[str, Any]] | None:
        pods = _get_json(dev_cluster, "pods", "-n", namespace, "-l", "app=spread")["items"]
        ok = len(pods) == 6 and all(p["status"].get("phase") == "Running" for p in pods)
        return pods if ok else None

    pods = wait_until("6 pods Running", all_running)
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 6, ips
    node_cidrs = {
        n["metadata"]["name"]: n["spec"]["podCIDR"]
        for n in _get_json(dev_cluster, "nodes")["items"]
    }
    assert len(set(node_cidrs.values())) == len(node_cidrs)
    for pod in pods:
        cidr = ipaddress.ip_network(node_cidrs[pod["spec"]["nodeName"]])
        assert ipaddress.ip_address(pod["status"]["podIP"]) in cidr


def test_server_side_dry_run_rejects_invalid_and_creates_nothing(
    dev_cluster: DevCluster, namespace: str
) -> None:
    invalid: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "bad"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "one"}},
            "template": {
                "metadata": {"labels": {"app": "other"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }
    args = ["apply", "--dry-run=server", "-n", namespace, "-f", "-"]
    result = _kubectl_stdin(dev_cluster, args, invalid, check=False)
    assert result.returncode != 0
    assert "Invalid" in result.stderr
    assert "selector" in result.stderr

    valid = dict(invalid, metadata={"name": "good"})
    valid["spec"] = dict(invalid["spec"], selector={"matchLabels": {"app": "other"}})
    result = _kubectl_stdin(dev_cluster, args, valid, check=False)
    assert result.returncode == 0, result.stderr
    assert "server dry run" in result.stdout
    missing = dev_cluster.kubectl("get", "deployment", "-n", namespace, "good", check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr


def test_helm_installs_a_chart(dev_cluster: DevCluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    dev_cluster.helm("install", "rel", str(chart), "-n", namespace, "--set", "greeting=hi")
    cm = _get_json(dev_cluster, "configmap", "-n", namespace, "rel-cm")
    assert cm["data"]["greeting"] == "hi"
    releases = json.loads(dev_cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [r["name"] for r in releases] == ["rel"]


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return None


def test_pod_agents_run_a_process_on_the_pod_ip_while_the_pod_exists(
    dev_cluster: DevCluster, namespace: str, pod_agents: Callable[..., PodAgentHarness]
) -> None:
    command = command_template(
        [sys.executable, "-m", "http.server", "--bind", "{pod_ip}", "18080"],
        selector=lambda pod: pod.labels.get("role") == "agent",
    )
    harness = pod_agents(command, namespace=namespace)
    _apply(dev_cluster, namespace, _gpu_pod("agent-0", gpus=1, labels={"role": "agent"}))
    _apply(dev_cluster, namespace, _gpu_pod("bystander", gpus=1, labels={"role": "other"}))
    pod = _running_pod(dev_cluster, namespace, "agent-0")
    _running_pod(dev_cluster, namespace, "bystander")

    proc = harness.wait_for(f"{namespace}/agent-0", timeout=30)
    assert proc.pod.pod_ip == pod["status"]["podIP"]
    url = f"http://{proc.pod.pod_ip}:18080/"
    wait_until("agent http server", lambda: _http_status(url) == 200, timeout=20)
    assert set(harness.processes()) == {f"{namespace}/agent-0"}

    _apply(dev_cluster, namespace, _gpu_pod("agent-1", gpus=1, labels={"role": "agent"}))
    other = harness.wait_for(f"{namespace}/agent-1", timeout=30)
    assert other.pod.pod_ip != proc.pod.pod_ip

    dev_cluster.kubectl("delete", "pod", "-n", namespace, "agent-0", "--wait=true")
    harness.wait_gone(f"{namespace}/agent-0", timeout=30)
    assert not proc.running()
    assert proc.popen.returncode == -signal.SIGTERM  # stopped gracefully, not killed
    assert _http_status(url) is None
    assert [p.pod.name for p in harness.finished()] == ["agent-0"]
    assert other.running()

    harness.stop()  # stopping the harness stops the remaining agents, gracefully too
    assert other.popen.returncode == -signal.SIGTERM


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool_dev", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_cli_up_and_down_run_a_second_cluster_beside_the_first(
    dev_cluster: DevCluster, tmp_path: Path
) -> None:
    from kvpool_dev.cluster import ClusterState, process_alive

    state_dir = tmp_path / "second"
    up = _cli("up", "--dir", str(state_dir), "--gpu-nodes", "1", "--gpus-per-node", "2")
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={state_dir / 'admin.kubeconfig'}" in up.stdout
        state = ClusterState.load(state_dir)
        assert state.server != dev_cluster.server
        assert all(process_alive(state, name) for name in state.pids)
        second = DevCluster.attach(state_dir)
        nodes = json.loads(second.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        assert [(n["metadata"]["name"], n["status"]["capacity"][GPU_RESOURCE]) for n in nodes] == [
            ("gpu-node-0", "2")
        ]
        assert _cli("status", "--dir", str(state_dir)).returncode == 0
    finally:
        down = _cli("down", "--dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    assert not any(process_alive(state, name) for name in state.pids)
    assert _cli("status", "--dir", str(state_dir)).returncode == 3
    # The session cluster is untouched.
    assert "ok" in dev_cluster.kubectl("get", "--raw", "/readyz").stdout
