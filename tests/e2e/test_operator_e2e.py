"""The operator (kopf, in-process) against the real control plane started from binaries.

kwok plays the kubelet, so pods of the agent StatefulSet turn Running and Ready with
127.x IPs; the kube-controller-manager runs the StatefulSet controller and the garbage
collector. Fake agents started by the ``pod_agents`` harness serve metrics on the pod IPs.
"""

from __future__ import annotations

import base64
import contextlib
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

from kvpool_dev.cluster import DevCluster
from kvpool_dev.podagents import command_template
from kvpool_dev.poll import wait_until

os.environ.setdefault("KVPOOL_TIMER_INTERVAL", "2")

import kopf
from kopf.testing import KopfRunner

from kvpool_agent.credentials import parse_tenants, token_digest
from kvpool_operator import children, handlers
from kvpool_operator.models import CONFIG_HASH_ANNOTATION, KVCachePool
from kvpool_operator.policy import OperatorPolicy

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "kvcachepools.yaml"


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


@contextlib.contextmanager
def running_operator(
    cluster: DevCluster,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    policy: OperatorPolicy | None = None,
) -> Iterator[KopfRunner]:
    """kopf running our handler registry, watching ``namespace``, with the operator's
    options (``kvpool operator`` flags) as the handlers' start-up reads them."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for key, value in (policy or OperatorPolicy()).to_environment().items():
        monkeypatch.setenv(key, value)
    settings = kopf.OperatorSettings()
    with KopfRunner(
        ["run", "--standalone", "--namespace", namespace, "--verbose"],
        registry=handlers.registry,
        settings=settings,
        timeout=60,
    ) as runner:
        yield runner
    assert runner.exception is None, runner.output[-5000:]


@pytest.fixture
def operator(
    crd: DevCluster, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[KopfRunner]:
    """kopf running our handler registry, watching the test's namespace."""
    with running_operator(crd, namespace, monkeypatch) as runner:
        yield runner


def get(cluster: DevCluster, namespace: str, what: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "-n", namespace, what, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def absent(cluster: DevCluster, namespace: str, what: str) -> bool:
    return get(cluster, namespace, what) is None


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
    pool = wait_until("the pool", lambda: get(crd, namespace, "kvp/demo"))
    for child in CHILDREN:
        obj = wait_until(child, functools.partial(get, crd, namespace, child.format(n="demo")))
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["uid"] == pool["metadata"]["uid"] and owner["controller"] is True
    sts = get(crd, namespace, "statefulset/demo")
    assert sts is not None
    pod_spec = sts["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod_spec["securityContext"]["runAsNonRoot"] is True

    ready = wait_until(
        "Ready=True",
        lambda: (p := get(crd, namespace, "kvp/demo")) and condition(p, "Ready") == "True" and p,
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
    wait_until("Ready", lambda: condition(get(crd, namespace, "kvp/roll"), "Ready") == "True")
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
    wait_until(
        "the live field in the ConfigMap",
        lambda: (
            "enable_block_reuse: false"
            in ((get(crd, namespace, "configmap/roll-agent-config") or {}).get("data") or {}).get(
                "agent.yaml", ""
            )
        ),
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
    wait_until("a new config hash", lambda: template_hash(crd, namespace, "roll") != first_hash)
    new_hash = template_hash(crd, namespace, "roll")
    wait_until(
        "Progressing=True during the roll",
        lambda: condition(get(crd, namespace, "kvp/roll"), "Progressing") == "True",
    )
    done = wait_until(
        "the roll to finish",
        lambda: (
            (p := get(crd, namespace, "kvp/roll"))
            and p.get("status", {}).get("configHash") == new_hash
            and condition(p, "Ready") == "True"
            and p
        ),
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
        wait_until(child, functools.partial(get, crd, namespace, child.format(n="gone")))
    crd.kubectl("delete", "-n", namespace, "kvp/gone", "--wait=true", "--timeout=60s")
    for child in CHILDREN:
        wait_until(
            f"{child} to be garbage-collected",
            functools.partial(absent, crd, namespace, child.format(n="gone")),
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
    scaled = wait_until(
        "the autoscaler to scale to 2",
        lambda: (
            (p := get(crd, namespace, "kvp/hot"))
            and p["spec"].get("replicas") == 2
            and (p.get("status") or {}).get("lastScaleTime")
            and p
        ),
        timeout=120,
    )
    assert scaled["status"]["cache"]["hitRate"] < 0.5
    wait_until(
        "the StatefulSet to follow",
        lambda: (get(crd, namespace, "statefulset/hot") or {}).get("spec", {}).get("replicas") == 2,
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
    wait_until("the StatefulSet", lambda: get(crd, namespace, "statefulset/idle"))
    crd.kubectl("scale", "-n", namespace, "kvp/idle", "--replicas=3")
    wait_until(
        "the autoscaler to step down to the floor",
        lambda: (get(crd, namespace, "kvp/idle") or {}).get("spec", {}).get("replicas") == 1,
        timeout=120,
    )
    assert "ScaledDown" in events(crd, namespace)


def test_external_mode_leaves_replicas_to_scale(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    doc = pool_manifest("ext", replicas=1, autoscaling={"mode": "external", "maxReplicas": 5})
    apply(crd, namespace, doc, tmp_path)
    wait_until("the StatefulSet", lambda: get(crd, namespace, "statefulset/ext"))
    crd.kubectl("scale", "-n", namespace, "kvp/ext", "--replicas=3")  # what an HPA does
    wait_until(
        "the StatefulSet to follow /scale",
        lambda: (get(crd, namespace, "statefulset/ext") or {}).get("spec", {}).get("replicas") == 3,
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
        wait_until("a warning", lambda: "ServiceMonitorUnavailable" in events(crd, namespace))
        # The warning is posted before the children are applied: the pool still gets them.
        wait_until("the StatefulSet", lambda: get(crd, namespace, "statefulset/mon"))
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
    monitor = wait_until(
        "the ServiceMonitor (created by the timer once its CRD exists)",
        lambda: get(crd, namespace, "servicemonitors.monitoring.coreos.com/mon"),
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    pool = get(crd, namespace, "kvp/mon")
    assert pool is not None
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]


# -- the trust model: credentials, NetworkPolicy, the operator's bounds on pools ------------
#
# The dev cluster runs no CNI, so nothing enforces a NetworkPolicy here: the policy is
# checked by its content and by the real API server's validation (server dry-run).


def secret_value(cluster: DevCluster, namespace: str, name: str, key: str) -> str | None:
    secret = get(cluster, namespace, f"secret/{name}")
    raw = ((secret or {}).get("data") or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None


def agent_tenants(cluster: DevCluster, namespace: str, pool: str) -> dict[str, str]:
    """token digest -> tenant, as the agents parse their mounted tenants file."""
    text = secret_value(cluster, namespace, f"{pool}-auth", "tenants.yaml")
    return parse_tenants(text, "tenants.yaml") if text is not None else {}


def test_operator_keeps_credentials_and_a_network_policy(
    crd: DevCluster, namespace: str, operator: KopfRunner, tmp_path: Path
) -> None:
    apply(crd, namespace, pool_manifest("sec", replicas=1), tmp_path)
    pool = wait_until("the pool", lambda: get(crd, namespace, "kvp/sec"))
    uid = pool["metadata"]["uid"]
    for child in ("secret/sec-auth", "secret/sec-tenant-default", "networkpolicy/sec"):
        obj = wait_until(child, functools.partial(get, crd, namespace, child))
        owner = obj["metadata"]["ownerReferences"][0]
        assert owner["uid"] == uid and owner["controller"] is True, child
    token = secret_value(crd, namespace, "sec-tenant-default", "token")
    peer = secret_value(crd, namespace, "sec-auth", "peer-token")
    assert token and peer and token != peer
    assert agent_tenants(crd, namespace, "sec") == {token_digest(token): "default"}

    sts = wait_until("the StatefulSet", lambda: get(crd, namespace, "statefulset/sec"))
    pod = sts["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    auth_volume = next(v for v in pod["volumes"] if v["name"] == "auth")
    assert auth_volume["secret"]["secretName"] == "sec-auth"
    config = (get(crd, namespace, "configmap/sec-agent-config") or {})["data"]["agent.yaml"]
    assert "host: 0.0.0.0" in config and "/etc/kvpool-auth/tenants.yaml" in config
    assert token not in config and peer not in config

    policy = get(crd, namespace, "networkpolicy/sec")
    assert policy is not None
    assert policy["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    (http,) = policy["spec"]["ingress"]  # no event consumers: the ZMQ ports stay closed
    assert http["ports"] == [{"port": p, "protocol": "TCP"} for p in ("http", "transfer")]
    assert {"podSelector": {"matchLabels": {"kvpool.io/client": "sec"}}} in http["from"]

    # Timer passes (every 2 s) read the Secrets back and keep the tokens.
    first_hash = template_hash(crd, namespace, "sec")
    time.sleep(6)
    assert secret_value(crd, namespace, "sec-tenant-default", "token") == token
    assert secret_value(crd, namespace, "sec-auth", "peer-token") == peer

    # Deleting a tenant's Secret rotates its token: back with a new one, the old revoked.
    crd.kubectl("delete", "-n", namespace, "secret/sec-tenant-default")
    new_token = wait_until(
        "the tenant Secret with a new token",
        lambda: (t := secret_value(crd, namespace, "sec-tenant-default", "token")) != token and t,
    )
    wait_until(
        "the agents' tenants file with the new digest only",
        lambda: agent_tenants(crd, namespace, "sec") == {token_digest(new_token): "default"},
    )
    assert secret_value(crd, namespace, "sec-auth", "peer-token") == peer
    assert template_hash(crd, namespace, "sec") == first_hash  # no pod rolls
    assert "TokenIssued" in events(crd, namespace)


def test_disallowed_image_and_foreign_peers_are_degraded_not_applied(
    crd: DevCluster, namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    policy = OperatorPolicy(allowed_image_prefixes=("registry.trusted.example/",))
    trusted = {"image": "registry.trusted.example/kvpool:1", "resources": {}}
    with running_operator(crd, namespace, monkeypatch, policy):
        apply(
            crd, namespace, pool_manifest("evil-image", pod={"image": "evil.example/x:1"}), tmp_path
        )
        peers = {"lifecycle": {"handoffPeers": ["http://collector.evil.example:8000"]}}
        apply(crd, namespace, pool_manifest("evil-peer", pod=trusted, agent=peers), tmp_path)
        apply(crd, namespace, pool_manifest("fine", pod=trusted), tmp_path)
        wait_until(
            "the allowed pool's StatefulSet", lambda: get(crd, namespace, "statefulset/fine")
        )

        def degraded(name: str) -> dict[str, Any] | None:
            for cond in ((get(crd, namespace, f"kvp/{name}") or {}).get("status") or {}).get(
                "conditions"
            ) or []:
                if cond["type"] == "Degraded" and cond["status"] == "True":
                    return dict(cond)
            return None

        image = wait_until("evil-image Degraded", lambda: degraded("evil-image"))
        assert image["reason"] == "ImageNotAllowed" and "spec.pod.image" in image["message"]
        peer = wait_until("evil-peer Degraded", lambda: degraded("evil-peer"))
        assert peer["reason"] == "HandoffPeerNotAllowed"
        assert "spec.agent.lifecycle.handoffPeers[0]" in peer["message"]
        time.sleep(4)  # timer passes change nothing: still nothing applied
        for name in ("evil-image", "evil-peer"):
            for child in (
                f"statefulset/{name}",
                f"secret/{name}-auth",
                f"configmap/{name}-agent-config",
            ):
                assert absent(crd, namespace, child), child
        warnings = json.loads(
            crd.kubectl(
                "get", "events", "-n", namespace, "--field-selector", "type=Warning", "-o", "json"
            ).stdout
        )["items"]
        found = {(e["involvedObject"]["name"], e["reason"]) for e in warnings}
        assert {("evil-image", "ImageNotAllowed"), ("evil-peer", "HandoffPeerNotAllowed")} <= found
        assert degraded("fine") is None


def test_node_sockets_are_refused_then_one_agent_per_node_once_allowed(
    crd: DevCluster, namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pool with spec.pod.nodeSocket under an operator that does not allow it is Degraded
    (NodeSocketNotAllowed) and gets no StatefulSet; once allowed, the real scheduler puts
    its agents one per node: two of three replicas on the two nodes, the third Pending."""
    pod = {"resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSocket": True}
    doc = pool_manifest("sock", replicas=3, pod=pod)

    def degraded() -> dict[str, Any] | None:
        pool = get(crd, namespace, "kvp/sock") or {}
        for cond in (pool.get("status") or {}).get("conditions") or []:
            if cond["type"] == "Degraded" and cond["status"] == "True":
                return dict(cond)
        return None

    with running_operator(crd, namespace, monkeypatch):
        apply(crd, namespace, doc, tmp_path)
        refused = wait_until("sock Degraded", degraded)
        assert refused["reason"] == "NodeSocketNotAllowed"
        assert "spec.pod.nodeSocket" in refused["message"]
        assert absent(crd, namespace, "statefulset/sock")
    with running_operator(crd, namespace, monkeypatch, OperatorPolicy(allow_node_sockets=True)):

        def placed() -> list[dict[str, Any]] | None:
            raw = crd.kubectl(
                "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/instance=sock",
                "-o", "json",
            ).stdout  # fmt: skip
            pods = json.loads(raw)["items"]
            on_nodes = [p for p in pods if p["spec"].get("nodeName")]
            unschedulable = [
                p
                for p in pods
                for c in (p.get("status") or {}).get("conditions") or []
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            ]
            return pods if len(on_nodes) == 2 and len(unschedulable) == 1 else None

        pods = wait_until("two agents placed and one unschedulable", placed)
        nodes = {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")}
        assert len(nodes) == 2  # one per node
        spec = pods[0]["spec"]
        (init,) = spec["initContainers"]
        assert init["name"] == "node-socket-dir"
        volume = next(v for v in spec["volumes"] if v["name"] == "node-socket")
        assert volume["hostPath"]["path"] == f"/var/run/kvpool/{namespace}/sock"
        assert wait_until("Degraded cleared", lambda: degraded() is None)


def test_rendered_children_pass_server_dry_run(
    crd: DevCluster, namespace: str, tmp_path: Path
) -> None:
    """Every child, the NetworkPolicy with every option set, validated by kube-apiserver
    itself (it does not enforce NetworkPolicy without a CNI, but it validates them)."""
    body = pool_manifest("dry")
    body["metadata"].update(namespace=namespace, uid="00000000-0000-0000-0000-000000000001")
    body["spec"]["auth"] = {"tenants": [{"name": "default"}, {"name": "team-b"}]}
    body["spec"]["network"] = {
        "clientSelector": {"app.kubernetes.io/name": "vllm"},
        "clientNamespaceSelector": {"kvpool.io/clients": "yes"},
        "eventConsumerSelector": {"app": "router"},
    }
    body["spec"]["pod"]["nodeSocket"] = True  # hostPath, root init container, anti-affinity
    pool = KVCachePool.model_validate(body)
    creds = children.PoolCredentials(
        peer_token="p" * 43,
        tenant_tokens={"default": "a" * 43, "team-b": "b" * 43},
        generated=frozenset({"default", "team-b"}),
    )
    operator_peer = children.OperatorPeer("kvpool-system", {"app.kubernetes.io/name": "kvpool"})
    docs = children.desired_children(pool, credentials=creds, operator=operator_peer)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Secret") == 3 and "NetworkPolicy" in kinds
    path = tmp_path / "children.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    out = crd.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
    assert out.returncode == 0, out.stderr
    accepted = [line for line in out.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), out.stdout
    assert "networkpolicy.networking.k8s.io/dry created (server dry run)" in out.stdout
