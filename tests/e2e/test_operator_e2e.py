"""The operator (kopf, in-process) against the real control plane started from binaries.

kwok plays the kubelet, so pods of the agent StatefulSet turn Running and Ready with
127.x IPs; the kube-controller-manager runs the StatefulSet controller and the garbage
collector. Fake agents started by the ``pod_agents`` harness serve metrics on the pod IPs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_operator.devcluster.cluster import DevCluster
from kvpool_operator.devcluster.podagents import command_template

os.environ.setdefault("KVPOOL_TIMER_INTERVAL", "2")

import kopf
from kopf.testing import KopfRunner

from kvpool_operator import handlers
from kvpool_operator.models import CONFIG_HASH_ANNOTATION

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "kvcachepools.yaml"
WAIT = 90.0


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": 2,
        "model": {"name": "tiny", "numLayers": 4, "numKvHeads": 2, "headDim": 64},
        "kvCacheConfig": {"tokensPerBlock": 16},
        "rollout": {"maxUnavailable": 1, "warmHandoffSeconds": 0},
        "pod": {"resources": {"limits": {"nvidia.com/gpu": 1}}},
    }
    base.update(spec)
    return {
        "apiVersion": "kvpool.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": base,
    }


@pytest.fixture(scope="module")
def crd(dev_cluster: DevCluster) -> DevCluster:
    dev_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    dev_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/kvcachepools.kvpool.io", "--timeout=60s"
    )
    return dev_cluster


@pytest.fixture
def operator(
    crd: DevCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KopfRunner]:
    """kopf running our handler registry, watching the test's namespace."""
    monkeypatch.setenv("KUBECONFIG", str(crd.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = kopf.OperatorSettings()
    with KopfRunner(
        ["run", "--standalone", "--namespace", namespace, "--verbose"],
        registry=handlers.registry,
        settings=settings,
        timeout=60,
    ) as runner:
        yield runner
    assert runner.exception is None, runner.output[-5000:]


def get(cluster: DevCluster, namespace: str, what: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "-n", namespace, what, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def absent(cluster: DevCluster, namespace: str, what: str) -> bool:
    return get(cluster, namespace, what) is None


def wait_for(probe: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def apply(cluster: DevCluster, namespace: str, doc: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / f"pool-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))


def pod_uids(cluster: DevCluster, namespace: str) -> set[str]:
    raw = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
    return {p["metadata"]["uid"] for p in json.loads(raw)["items"]}


def condition(pool: dict[str, Any] | None, kind: str) -> str | None:
    for cond in ((pool or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return str(cond["status"])
    return None


def template_hash(cluster: DevCluster, namespace: str, name: str) -> str:
    sts = get(cluster, namespace, f"statefulset/{name}")
    assert sts is not None
    return str(sts["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


CHILDREN = (
    "statefulset/{n}",
    "service/{n}",
    "configmap/{n}-agent-config",
    "poddisruptionbudget/{n}",
)


def test_pool_gets_owned_children_and_turns_ready(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    apply(crd, namespace, pool_manifest("demo"), tmp_path)
    pool = wait_for(lambda: get(crd, namespace, "kvp/demo"), "the pool")
    for child in CHILDREN:
        obj = wait_for(functools.partial(get, crd, namespace, child.format(n="demo")), child)
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["uid"] == pool["metadata"]["uid"] and owner["controller"] is True
    sts = get(crd, namespace, "statefulset/demo")
    assert sts is not None
    pod_spec = sts["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True

    ready = wait_for(
        lambda: (p := get(crd, namespace, "kvp/demo")) and condition(p, "Ready") == "True" and p,
        "Ready=True",
    )
    status = ready["status"]
    assert status["readyReplicas"] == 2 and status["updatedReplicas"] == 2
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert condition(ready, "Progressing") == "False"
    assert condition(ready, "Degraded") == "False"
    events = crd.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "Created" in {e["reason"] for e in json.loads(events)["items"]}


def test_live_edit_reloads_and_restart_edit_rolls(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    # minReadySeconds slows the roll down enough for the 2 s timer to see it in progress.
    doc = pool_manifest("roll", rollout={"maxUnavailable": 1, "warmHandoffSeconds": 4})
    apply(crd, namespace, doc, tmp_path)
    wait_for(lambda: condition(get(crd, namespace, "kvp/roll"), "Ready") == "True", "Ready")
    first_hash = template_hash(crd, namespace, "roll")
    pods_before = pod_uids(crd, namespace)

    crd.kubectl(
        "patch",
        "-n",
        namespace,
        "kvp/roll",
        "--type=merge",
        "-p",
        '{"spec":{"kvCacheConfig":{"enableBlockReuse":false}}}',
    )
    wait_for(
        lambda: (
            "enable_block_reuse: false"
            in ((get(crd, namespace, "configmap/roll-agent-config") or {}).get("data") or {}).get(
                "agent.yaml", ""
            )
        ),
        "the live field in the ConfigMap",
    )
    assert template_hash(crd, namespace, "roll") == first_hash
    time.sleep(3)
    assert pod_uids(crd, namespace) == pods_before  # a live change restarts no pod

    crd.kubectl(
        "patch",
        "-n",
        namespace,
        "kvp/roll",
        "--type=merge",
        "-p",
        '{"spec":{"kvCacheConfig":{"hostCacheSize":1048576}}}',
    )
    wait_for(lambda: template_hash(crd, namespace, "roll") != first_hash, "a new config hash")
    new_hash = template_hash(crd, namespace, "roll")
    wait_for(
        lambda: condition(get(crd, namespace, "kvp/roll"), "Progressing") == "True",
        "Progressing=True during the roll",
    )
    done = wait_for(
        lambda: (
            (p := get(crd, namespace, "kvp/roll"))
            and p.get("status", {}).get("configHash") == new_hash
            and condition(p, "Ready") == "True"
            and p
        ),
        "the roll to finish",
        timeout=120,
    )
    assert done["status"]["updatedReplicas"] == 2
    assert condition(done, "Progressing") == "False"
    assert not pod_uids(crd, namespace) & pods_before  # every pod was replaced
    reasons = {
        e["reason"]
        for e in json.loads(crd.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)[
            "items"
        ]
    }
    assert {"ConfigReloaded", "RollingRestart"} <= reasons


def test_deleting_a_pool_collects_its_children(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    apply(crd, namespace, pool_manifest("gone"), tmp_path)
    for child in CHILDREN:
        wait_for(functools.partial(get, crd, namespace, child.format(n="gone")), child)
    crd.kubectl("delete", "-n", namespace, "kvp/gone", "--wait=true", "--timeout=60s")
    for child in CHILDREN:
        wait_for(
            functools.partial(absent, crd, namespace, child.format(n="gone")),
            f"{child} to be garbage-collected",
        )


FAKE_AGENT = r"""
import http.server, sys, threading
ip, port, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
hit, capacity, used = (0.4, 0.5, 98) if profile == "hot" else (0.9, 0.0, 10)
state = {"q": 0.0}
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/metrics":
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok"); return
        with lock:
            state["q"] += 10000.0
            q = state["q"]
        body = (
            f"kvpool_prefix_cache_queries_tokens_total {q}\n"
            f'kvpool_prefix_cache_hits_tokens_total{{tier="primary"}} {q * hit}\n'
            f"kvpool_prefix_cache_capacity_misses_tokens_total {q * capacity}\n"
            f'kvpool_cache_blocks_used{{pool="p0",tier="primary"}} {used}\n'
            f'kvpool_cache_blocks_total{{pool="p0",tier="primary"}} 100\n'
        ).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((ip, port), H).serve_forever()
"""


def test_builtin_autoscaler_scales_a_hot_pool(
    crd: DevCluster,
    namespace: str,
    operator: KopfRunner,
    pod_agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Agents report a 40% hit rate, mostly capacity misses, a full cache: scale up to max."""
    script = tmp_path / "fake_agent.py"
    script.write_text(FAKE_AGENT)
    pod_agents(
        command_template([sys.executable, str(script), "{pod_ip}", "8000", "hot"]),
        namespace=namespace,
    )
    doc = pool_manifest(
        "hot",
        autoscaling={
            "minReplicas": 1,
            "maxReplicas": 2,
            "scaleUpStabilizationSeconds": 0,
        },
    )
    del doc["spec"]["replicas"]
    apply(crd, namespace, doc, tmp_path)
    scaled = wait_for(
        lambda: (
            (p := get(crd, namespace, "kvp/hot"))
            and p["spec"].get("replicas") == 2
            and (p.get("status") or {}).get("lastScaleTime")
            and p
        ),
        "the autoscaler to scale to 2",
        timeout=120,
    )
    assert scaled["status"]["cache"]["hitRate"] < 0.5
    wait_for(
        lambda: (get(crd, namespace, "statefulset/hot") or {}).get("spec", {}).get("replicas") == 2,
        "the StatefulSet to follow",
    )
    reasons = {
        e["reason"]
        for e in json.loads(crd.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)[
            "items"
        ]
    }
    assert "ScaledUp" in reasons


def events(cluster: DevCluster, namespace: str) -> set[str]:
    raw = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    return {e["reason"] for e in json.loads(raw)["items"]}


def test_builtin_autoscaler_scales_an_idle_pool_down(
    crd: DevCluster,
    namespace: str,
    operator: KopfRunner,
    pod_agents: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """Agents report a mostly empty cache and no capacity misses: back to the floor."""
    script = tmp_path / "fake_agent.py"
    script.write_text(FAKE_AGENT)
    pod_agents(
        command_template([sys.executable, str(script), "{pod_ip}", "8000", "idle"]),
        namespace=namespace,
    )
    doc = pool_manifest(
        "idle",
        autoscaling={"minReplicas": 1, "maxReplicas": 3, "scaleDownStabilizationSeconds": 4},
    )
    del doc["spec"]["replicas"]
    apply(crd, namespace, doc, tmp_path)
    wait_for(lambda: get(crd, namespace, "statefulset/idle"), "the StatefulSet")
    crd.kubectl("scale", "-n", namespace, "kvp/idle", "--replicas=3")
    wait_for(
        lambda: (get(crd, namespace, "kvp/idle") or {}).get("spec", {}).get("replicas") == 1,
        "the autoscaler to step down to the floor",
        timeout=120,
    )
    assert "ScaledDown" in events(crd, namespace)


def test_external_mode_leaves_replicas_to_scale(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    doc = pool_manifest("ext", replicas=1, autoscaling={"mode": "external", "maxReplicas": 5})
    apply(crd, namespace, doc, tmp_path)
    wait_for(lambda: get(crd, namespace, "statefulset/ext"), "the StatefulSet")
    crd.kubectl("scale", "-n", namespace, "kvp/ext", "--replicas=3")  # what an HPA does
    wait_for(
        lambda: (get(crd, namespace, "statefulset/ext") or {}).get("spec", {}).get("replicas") == 3,
        "the StatefulSet to follow /scale",
    )
    time.sleep(6)  # a few timer ticks: the operator must not move replicas itself
    pool = get(crd, namespace, "kvp/ext")
    assert pool is not None and pool["spec"]["replicas"] == 3
    assert not {"ScaledUp", "ScaledDown"} & events(crd, namespace)


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
            "listKind": "ServiceMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_servicemonitor_waits_for_its_crd(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    served = crd.kubectl("get", "crd", "servicemonitors.monitoring.coreos.com", check=False)
    if served.returncode != 0:  # first run in this cluster: check the warning path too
        apply(crd, namespace, pool_manifest("mon", monitoring={"serviceMonitor": True}), tmp_path)
        wait_for(lambda: "ServiceMonitorUnavailable" in events(crd, namespace), "a warning")
        assert get(crd, namespace, "statefulset/mon") is not None
        path = tmp_path / "sm-crd.yaml"
        path.write_text(yaml.safe_dump(SERVICE_MONITOR_CRD))
        crd.kubectl("apply", "-f", str(path))
        crd.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/servicemonitors.monitoring.coreos.com",
            "--timeout=60s",
        )
    else:
        apply(crd, namespace, pool_manifest("mon", monitoring={"serviceMonitor": True}), tmp_path)
    monitor = wait_for(
        lambda: get(crd, namespace, "servicemonitors.monitoring.coreos.com/mon"),
        "the ServiceMonitor (created by the timer once its CRD exists)",
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    pool = get(crd, namespace, "kvp/mon")
    assert pool is not None
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
