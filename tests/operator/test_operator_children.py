"""The child manifests are pure functions of the pool: checked as data, no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvpool_agent.config import LIVE_FIELDS, load_agent_config
from kvpool_operator import children
from kvpool_operator.models import CONFIG_HASH_ANNOTATION, KVCachePool


def _pool(body: dict[str, Any]) -> KVCachePool:
    return KVCachePool.model_validate(body)


def _template_hash(pool: KVCachePool) -> str:
    sts = children.desired_statefulset(pool)
    return sts["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]


def test_every_child_is_owned_by_the_pool(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    kids = children.desired_children(pool, service_monitor=True)
    assert [k["kind"] for k in kids] == [
        "ConfigMap",
        "Service",
        "StatefulSet",
        "PodDisruptionBudget",
        "ServiceMonitor",
    ]
    for kid in kids:
        (owner,) = kid["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "kvpool.io/v1alpha1",
            "kind": "KVCachePool",
            "name": "demo",
            "uid": "uid-1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert kid["metadata"]["namespace"] == "ns1"
        assert kid["metadata"]["labels"]["kvpool.io/pool"] == "demo"


def test_statefulset_runs_agents_on_gpus_as_non_root(pool_body: dict[str, Any]) -> None:
    sts = children.desired_statefulset(_pool(pool_body))
    spec = sts["spec"]
    assert spec["replicas"] == 2 and spec["serviceName"] == "demo"
    assert spec["selector"]["matchLabels"].items() <= (
        spec["template"]["metadata"]["labels"].items()
    )
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "yes"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    (agent,) = pod["containers"]
    assert agent["image"] == "registry.local/kvpool:test"
    assert agent["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert agent["command"] + agent["args"] == [
        "kvpool",
        "agent",
        "--config",
        "/etc/kvpool/agent.yaml",
    ]
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["ports"][0]["containerPort"] == 8000
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/kvpool" and "subPath" not in mount
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "demo-agent-config"


def test_rollout_settings_reach_the_statefulset_and_pdb(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["rollout"] = {"maxUnavailable": "50%", "warmHandoffSeconds": 45}
    pool = _pool(pool_body)
    sts = children.desired_statefulset(pool)
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "50%"
    assert sts["spec"]["minReadySeconds"] == 45
    assert children.desired_pdb(pool)["spec"]["maxUnavailable"] == "50%"


def test_configmap_holds_a_loadable_agent_config(pool_body: dict[str, Any], tmp_path: Path) -> None:
    pool_body["spec"]["model"]["numKvHeadsPerLayer"] = [2, 2, 4, 4]
    cm = children.desired_configmap(_pool(pool_body))
    path = tmp_path / "agent.yaml"
    path.write_text(cm["data"]["agent.yaml"])
    config = load_agent_config(path)
    assert config.model.num_kv_heads == [2, 2, 4, 4]
    assert config.kv_cache_config.tokens_per_block == 16


def test_live_field_change_keeps_the_hash(pool_body: dict[str, Any]) -> None:
    before = _pool(pool_body)
    pool_body["spec"]["kvCacheConfig"]["enableBlockReuse"] = False
    pool_body["spec"]["kvCacheConfig"]["secondaryOffloadMinPriority"] = 50
    after = _pool(pool_body)
    assert _template_hash(before) == _template_hash(after)
    assert children.desired_configmap(before) != children.desired_configmap(after)


def test_restart_field_change_rolls_the_hash(pool_body: dict[str, Any]) -> None:
    before = _template_hash(_pool(pool_body))
    pool_body["spec"]["kvCacheConfig"]["freeGpuMemoryFraction"] = 0.5
    assert _template_hash(_pool(pool_body)) != before


def test_every_live_field_is_left_out_of_the_hash(pool_body: dict[str, Any]) -> None:
    doc = children.restart_relevant(_pool(pool_body).spec.agent_config())
    for path in LIVE_FIELDS:
        section, leaf = path.split(".")
        assert leaf not in doc[section]


def test_servicemonitor_scrapes_the_http_port(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["monitoring"] = {"serviceMonitor": True, "labels": {"release": "prom"}}
    mon = children.desired_servicemonitor(_pool(pool_body))
    assert mon["metadata"]["labels"]["release"] == "prom"
    assert mon["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    svc = children.desired_service(_pool(pool_body))
    assert svc["spec"]["clusterIP"] == "None"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_autoscaled_pool_starts_at_its_floor(pool_body: dict[str, Any]) -> None:
    del pool_body["spec"]["replicas"]
    pool_body["spec"]["autoscaling"] = {"minReplicas": 3, "maxReplicas": 5}
    assert children.desired_statefulset(_pool(pool_body))["spec"]["replicas"] == 3
    pool_body["spec"]["replicas"] = 9  # clamped while the built-in autoscaler owns replicas
    assert children.desired_statefulset(_pool(pool_body))["spec"]["replicas"] == 5


def test_manifests_serialize_to_yaml(pool_body: dict[str, Any]) -> None:
    for kid in children.desired_children(_pool(pool_body)):
        assert yaml.safe_load(yaml.safe_dump(kid)) == kid


def test_warm_handoff_lists_the_pools_pods_as_peers(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    peers = children.pool_agent_config(pool, replicas=3).lifecycle.handoff_peers
    assert peers == [f"http://demo-{i}.demo.ns1.svc:8000" for i in range(3)]
    # Peers follow the replica count, but they are live: the pods do not roll on a scale.
    two = children.desired_configmap(pool, replicas=2)
    three = children.desired_configmap(pool, replicas=3)
    assert two["data"] != three["data"]
    pool_body["spec"]["rollout"] = {"warmHandoff": False}
    assert children.pool_agent_config(_pool(pool_body), 3).lifecycle.handoff_peers == []


def test_given_peers_are_kept(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["agent"] = {"lifecycle": {"handoffPeers": ["http://elsewhere:8000"]}}
    config = children.pool_agent_config(_pool(pool_body), 3)
    assert config.lifecycle.handoff_peers == ["http://elsewhere:8000"]


def test_grace_period_and_event_ports_reach_the_pod(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["agent"] = {"lifecycle": {"gracePeriodS": 40.5}}
    pool = _pool(pool_body)
    pod = children.desired_statefulset(pool)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 46
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    svc_ports = {p["name"] for p in children.desired_service(pool)["spec"]["ports"]}
    assert svc_ports == {"http", "kv-events", "kv-replay"}
