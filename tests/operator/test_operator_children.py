"""The child manifests are pure functions of the pool: checked as data, no I/O."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from kvpool_agent.config import LIVE_FIELDS, load_agent_config
from kvpool_agent.credentials import parse_tenants, token_digest
from kvpool_operator import children
from kvpool_operator.models import CONFIG_HASH_ANNOTATION, KVCachePool


def _pool(body: dict[str, Any]) -> KVCachePool:
    return KVCachePool.model_validate(body)


def _template_hash(pool: KVCachePool) -> str:
    sts = children.desired_statefulset(pool)
    return sts["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]


CREDENTIALS = children.PoolCredentials(
    peer_token="peer-secret",
    tenant_tokens={"default": "tenant-secret"},
    generated=frozenset({"default"}),
)


def test_every_child_is_owned_by_the_pool(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    kids = children.desired_children(pool, service_monitor=True, credentials=CREDENTIALS)
    assert [(k["kind"], k["metadata"]["name"]) for k in kids] == [
        ("Secret", "demo-tenant-default"),
        ("Secret", "demo-auth"),
        ("ConfigMap", "demo-agent-config"),
        ("Service", "demo"),
        ("NetworkPolicy", "demo"),
        ("StatefulSet", "demo"),
        ("PodDisruptionBudget", "demo"),
        ("ServiceMonitor", "demo"),
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
    for kid in children.desired_children(_pool(pool_body), credentials=CREDENTIALS):
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
    assert ports == {"http": 8000, "transfer": 8100, "kv-events": 5557, "kv-replay": 5558}
    svc_ports = {p["name"] for p in children.desired_service(pool)["spec"]["ports"]}
    assert svc_ports == {"http", "transfer", "kv-events", "kv-replay"}


# -- credentials and the NetworkPolicy (the agent trust model) ------------------------------


def _decoded(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def test_pods_serve_the_pod_network_with_mounted_credentials(
    pool_body: dict[str, Any], tmp_path: Path
) -> None:
    pool = _pool(pool_body)
    cm = children.desired_configmap(pool)
    path = tmp_path / "agent.yaml"
    path.write_text(cm["data"]["agent.yaml"])
    config = load_agent_config(path)  # the agent's own validator: non-loopback needs auth
    assert config.server.host == "0.0.0.0"
    assert config.auth.tenants_file == "/etc/kvpool-auth/tenants.yaml"
    assert config.auth.peer_token_file == "/etc/kvpool-auth/peer-token"
    assert config.auth.allow_unauthenticated is False

    pod = children.desired_statefulset(pool)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (agent,) = pod["containers"]
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "auth")
    assert mount == {"name": "auth", "mountPath": "/etc/kvpool-auth", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "auth")
    # A directory mount (no subPath, no items): kubelet refreshes it in place.
    assert volume["secret"] == {"secretName": "demo-auth", "defaultMode": 0o440}
    for path_in_config in (config.auth.tenants_file, config.auth.peer_token_file):
        assert str(path_in_config).startswith(mount["mountPath"] + "/")


def test_auth_secret_holds_digests_and_the_peer_token(pool_body: dict[str, Any]) -> None:
    creds = children.PoolCredentials(
        peer_token="peer-tok",
        tenant_tokens={"team-b": "tok-b", "default": "tok-a"},
        generated=frozenset({"default"}),
    )
    secret = children.desired_auth_secret(_pool(pool_body), creds)
    assert secret["type"] == "Opaque" and set(secret["data"]) == {"tenants.yaml", "peer-token"}
    text = _decoded(secret, "tenants.yaml")
    assert "tok-a" not in text and "tok-b" not in text
    # The agent's own parser reads it back: digest -> tenant.
    assert parse_tenants(text, "test") == {
        token_digest("tok-a"): "default",
        token_digest("tok-b"): "team-b",
    }
    assert _decoded(secret, "peer-token") == "peer-tok"
    empty = children.PoolCredentials(peer_token="p", tenant_tokens={})
    assert (
        parse_tenants(
            _decoded(children.desired_auth_secret(_pool(pool_body), empty), "tenants.yaml"), "t"
        )
        == {}
    )


def test_one_secret_per_generated_tenant(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["auth"] = {
        "tenants": [{"name": "default"}, {"name": "byo", "secretName": "my-token"}, {"name": "b"}]
    }
    pool = _pool(pool_body)
    creds = children.PoolCredentials(
        peer_token="p",
        tenant_tokens={"default": "t1", "byo": "t2", "b": "t3"},
        generated=frozenset({"default", "b"}),
    )
    secrets = children.desired_secrets(pool, creds)
    assert [s["metadata"]["name"] for s in secrets] == [
        "demo-tenant-default",
        "demo-tenant-b",
        "demo-auth",
    ]
    tenant = secrets[0]
    assert tenant["metadata"]["labels"]["kvpool.io/tenant"] == "default"
    assert tenant["metadata"]["labels"]["kvpool.io/pool"] == "demo"
    assert _decoded(tenant, "token") == "t1"
    assert tenant["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    # The user's own Secret is read, never written; its tenant is in the digests.
    assert token_digest("t2") in _decoded(secrets[-1], "tenants.yaml")


def test_tokens_and_tenants_never_roll_the_pods(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    before = children.desired_statefulset(pool)
    other = children.PoolCredentials(peer_token="x", tenant_tokens={"default": "y"})
    for creds in (CREDENTIALS, other):
        kids = children.desired_children(pool, credentials=creds)
        (sts,) = [k for k in kids if k["kind"] == "StatefulSet"]
        assert sts == before
    pool_body["spec"]["auth"] = {"tenants": [{"name": "default"}, {"name": "new-team"}]}
    after = children.desired_statefulset(_pool(pool_body))
    assert before == after
    assert children.desired_configmap(pool) == children.desired_configmap(_pool(pool_body))


def test_network_policy_admits_clients_peers_and_the_operator(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    policy = children.desired_network_policy(pool)
    spec = policy["spec"]
    selector = children.selector_labels(pool)
    assert spec["podSelector"] == {"matchLabels": selector}
    assert spec["policyTypes"] == ["Ingress"]
    (http,) = spec["ingress"]  # no event consumers by default: the ZMQ ports are closed
    assert http["ports"] == [{"protocol": "TCP", "port": p} for p in ("http", "transfer")]
    assert http["from"] == [
        {"podSelector": {"matchLabels": {"kvpool.io/client": "demo"}}},
        {"podSelector": {"matchLabels": selector}},
    ]
    operator = children.OperatorPeer("kvpool-system", {"app.kubernetes.io/name": "kvpool"})
    with_operator = children.desired_network_policy(pool, operator)
    assert with_operator["spec"]["ingress"][0]["from"][-1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kvpool-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpool"}},
    }
    # Named ports: the agent container declares them.
    container_ports = {
        p["name"] for p in children.desired_pod_template(pool)["spec"]["containers"][0]["ports"]
    }
    assert "http" in container_ports


def test_network_policy_selectors_and_event_consumers(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["network"] = {
        "clientSelector": {"app": "vllm"},
        "clientNamespaceSelector": {"team": "serving"},
        "eventConsumerSelector": {"app": "router"},
    }
    spec = children.desired_network_policy(_pool(pool_body))["spec"]
    http, events = spec["ingress"]
    assert http["from"][0] == {
        "podSelector": {"matchLabels": {"app": "vllm"}},
        "namespaceSelector": {"matchLabels": {"team": "serving"}},
    }
    # The pool's own pods: same namespace, no namespaceSelector.
    assert http["from"][1] == {
        "podSelector": {"matchLabels": children.selector_labels(_pool(pool_body))}
    }
    assert events["from"] == [
        {
            "podSelector": {"matchLabels": {"app": "router"}},
            "namespaceSelector": {"matchLabels": {"team": "serving"}},
        }
    ]
    assert events["ports"] == [
        {"protocol": "TCP", "port": "kv-events"},
        {"protocol": "TCP", "port": "kv-replay"},
    ]
    pool_body["spec"]["agent"] = {"events": {"endpoint": None, "replayEndpoint": None}}
    assert len(children.desired_network_policy(_pool(pool_body))["spec"]["ingress"]) == 1


def test_network_policy_can_be_turned_off(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["network"] = {"policy": False}
    kinds = [k["kind"] for k in children.desired_children(_pool(pool_body))]
    assert "NetworkPolicy" not in kinds


def test_own_peer_urls(pool_body: dict[str, Any]) -> None:
    pool = _pool(pool_body)
    for url in children.peer_urls(pool, 12):
        assert children.own_peer_url(pool, url)
    assert children.own_peer_url(pool, "http://demo-3.demo.ns1.svc.cluster.local:8000/")
    for url in [
        "http://demo-0.demo.ns2.svc:8000",  # another namespace
        "http://other-0.other.ns1.svc:8000",  # another pool
        "http://demo-0.demo.ns1.svc:9000",  # another port
        "https://demo-0.demo.ns1.svc:8000",
        "http://demo-01.demo.ns1.svc:8000",
        "http://demo-0.demo.ns1.svc:8000/steal",
        "http://demo-0xdemo.ns1.svc:8000",
        "http://evil.example:8000",
    ]:
        assert not children.own_peer_url(pool, url), url


def test_the_transfer_port_is_exposed_to_clients_only(pool_body: dict[str, Any]) -> None:
    """Engine connectors reach the binary transfer port: on the container, the Service and in
    the NetworkPolicy's client rule (never the event consumers' one); null disables it."""
    from kvpool_operator.children import (
        desired_network_policy,
        desired_pod_template,
        desired_service,
    )

    pool = _pool({**pool_body, "spec": {**pool_body["spec"], "network": {
        "eventConsumerSelector": {"app": "indexer"}}}})  # fmt: skip
    container = desired_pod_template(pool)["spec"]["containers"][0]
    assert {"name": "transfer", "containerPort": 8100, "protocol": "TCP"} in container["ports"]
    assert any(p["name"] == "transfer" for p in desired_service(pool)["spec"]["ports"])
    ingress = desired_network_policy(pool)["spec"]["ingress"]
    assert {"protocol": "TCP", "port": "transfer"} in ingress[0]["ports"]
    assert len(ingress) == 2  # clients, then event consumers
    assert {"protocol": "TCP", "port": "transfer"} not in ingress[1]["ports"]
