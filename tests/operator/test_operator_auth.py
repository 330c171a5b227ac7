"""The trust model's operator side as data: tenants in the CRD models, the operator's bounds
on pools (allowed images, handoff peers) and how existing Secrets' tokens are read back."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from pydantic import ValidationError

from kvpool_operator import children, tokens
from kvpool_operator.crd import spec_schema
from kvpool_operator.models import KVCachePool
from kvpool_operator.policy import (
    HANDOFF_PEER_NOT_ALLOWED,
    IMAGE_NOT_ALLOWED,
    OperatorPolicy,
    parse_labels,
)
from kvpool_operator.schema import at_path


def _pool(body: dict[str, Any]) -> KVCachePool:
    return KVCachePool.model_validate(body)


# -- spec.auth and spec.network ------------------------------------------------------------


def test_one_default_tenant_and_a_policy_by_default(pool_body: dict[str, Any]) -> None:
    spec = _pool(pool_body).spec
    assert [t.name for t in spec.auth.tenants] == ["default"]
    assert spec.auth.tenants[0].secret_name is None
    assert spec.network.policy is True
    assert spec.network.clients("demo") == {"kvpool.io/client": "demo"}
    assert spec.network.client_namespace_selector is None
    assert spec.network.event_consumer_selector is None


def test_crd_defaults_match_the_models() -> None:
    schema = spec_schema()
    tenants = at_path(schema, ("auth", "tenants"))
    assert tenants["default"] == [{"name": "default"}]
    assert tenants["x-kubernetes-list-type"] == "map"  # the API server refuses duplicates
    assert tenants["x-kubernetes-list-map-keys"] == ["name"]
    assert tenants["maxItems"] == 64
    assert at_path(schema, ("auth", "tenants", "[*]", "name"))["pattern"].startswith("^[a-z0-9]")
    assert at_path(schema, ("network", "policy"))["default"] is True
    assert at_path(schema, ("auth",))["default"] == {}
    assert at_path(schema, ("network",))["default"] == {}


@pytest.mark.parametrize(
    ("tenants", "message"),
    [
        ([{"name": "a"}, {"name": "a"}], "more than once"),
        ([{"name": "Team_A"}], "pattern"),
        ([{"name": "-a"}], "pattern"),
        ([{"name": "a" * 64}], "at most 63"),
        ([{"name": "a", "secretName": "Bad Name"}], "pattern"),
        ([{"name": f"t{i}"} for i in range(65)], "at most 64"),
        ([{"secretName": "x"}], "Field required"),
    ],
)
def test_bad_tenants_are_refused(
    pool_body: dict[str, Any], tenants: list[dict[str, Any]], message: str
) -> None:
    pool_body["spec"]["auth"] = {"tenants": tenants}
    with pytest.raises(ValidationError, match=message):
        _pool(pool_body)


def test_no_tenants_is_a_closed_pool(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["auth"] = {"tenants": []}
    creds = children.PoolCredentials(peer_token="p", tenant_tokens={})
    secrets = children.desired_secrets(_pool(pool_body), creds)
    assert [s["metadata"]["name"] for s in secrets] == ["demo-auth"]


# -- the operator's bounds -----------------------------------------------------------------


def test_any_image_and_own_peers_by_default(pool_body: dict[str, Any]) -> None:
    policy = OperatorPolicy()
    assert policy.violation(_pool(pool_body)) is None
    pool_body["spec"]["agent"] = {
        "lifecycle": {"handoffPeers": children.peer_urls(_pool(pool_body), 3)}
    }
    assert policy.violation(_pool(pool_body)) is None
    pool_body["spec"]["agent"]["lifecycle"]["handoffPeers"].append("http://sink.other.svc:8000")
    problem = policy.violation(_pool(pool_body))
    assert problem is not None and problem.reason == HANDOFF_PEER_NOT_ALLOWED
    assert "spec.agent.lifecycle.handoffPeers[3]" in problem.message
    assert "http://sink.other.svc:8000" in problem.message
    assert OperatorPolicy(allow_foreign_handoff_peers=True).violation(_pool(pool_body)) is None


def test_image_prefixes(pool_body: dict[str, Any]) -> None:
    policy = OperatorPolicy(allowed_image_prefixes=("ghcr.io/kvpool/", "registry.local/"))
    assert policy.violation(_pool(pool_body)) is None  # registry.local/kvpool:test
    pool_body["spec"]["pod"]["image"] = "ghcr.io/kvpool-evil/kvpool:1"
    problem = policy.violation(_pool(pool_body))
    assert problem is not None and problem.reason == IMAGE_NOT_ALLOWED
    assert "spec.pod.image" in problem.message and "ghcr.io/kvpool-evil" in problem.message
    del pool_body["spec"]["pod"]["image"]  # the CRD default is checked like any other
    assert policy.violation(_pool(pool_body)) is None


def test_policy_travels_through_the_environment() -> None:
    policy = OperatorPolicy(
        allowed_image_prefixes=("a/", "b/"),
        allow_foreign_handoff_peers=True,
        operator_namespace="ops",
        operator_pod_labels={"app.kubernetes.io/name": "kvpool", "tier": "control"},
    )
    assert OperatorPolicy.from_environment(policy.to_environment()) == policy
    assert OperatorPolicy.from_environment({}) == OperatorPolicy()
    assert OperatorPolicy.from_environment({}).operator_peer is None
    peer = policy.operator_peer
    assert peer is not None and peer.namespace == "ops"
    # The chart sets POD_NAMESPACE from the downward API.
    env = {"POD_NAMESPACE": "kvpool-system", "KVPOOL_OPERATOR_POD_LABELS": "a=b"}
    assert OperatorPolicy.from_environment(env).operator_peer == children.OperatorPeer(
        "kvpool-system", {"a": "b"}
    )
    with pytest.raises(ValueError, match="JSON list"):
        OperatorPolicy.from_environment({"KVPOOL_ALLOWED_IMAGE_PREFIXES": '"a/"'})


def test_parse_labels() -> None:
    assert parse_labels("") == {}
    assert parse_labels("a=b, c.io/d=e,") == {"a": "b", "c.io/d": "e"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_labels("a=b,oops")


def test_operator_flags_reach_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_cli import build_parser

    args = build_parser().parse_args(
        [
            "operator",
            "--allowed-image-prefix",
            "ghcr.io/kvpool/",
            "--allowed-image-prefix=registry.local/",
            "--allow-foreign-handoff-peers",
            "--operator-pod-labels",
            "app=kvpool,component=operator",
        ]
    )
    assert args.allowed_image_prefix == ["ghcr.io/kvpool/", "registry.local/"]
    assert args.allow_foreign_handoff_peers is True
    assert args.operator_pod_labels == "app=kvpool,component=operator"
    defaults = build_parser().parse_args(["operator"])
    assert defaults.allowed_image_prefix == [] and defaults.allow_foreign_handoff_peers is False


# -- tokens read back from Secrets ---------------------------------------------------------


def _secret(data: dict[str, str], uid: str | None = "uid-1234", **meta: Any) -> dict[str, Any]:
    refs = [{"uid": uid, "controller": True}] if uid else []
    return {
        "metadata": {"ownerReferences": refs, **meta},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def test_secret_value_accepts_one_token() -> None:
    assert tokens.secret_value(_secret({"token": "abc\n"}), "token") == "abc"
    for bad in ({"token": ""}, {"token": "a b"}, {"token": "x" * 513}, {"other": "abc"}):
        assert tokens.secret_value(_secret(bad), "token") is None, bad
    assert tokens.secret_value({"data": {"token": "%%%"}}, "token") is None
    assert tokens.secret_value(None, "token") is None


class FakeApi:
    """``get`` and ``delete`` over a dict of Secrets by name."""

    def __init__(self, secrets: dict[str, dict[str, Any]]) -> None:
        self.secrets = secrets
        self.deleted: list[str] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        assert (api_version, kind, namespace) == ("v1", "Secret", "ns1")
        return self.secrets.get(name)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self.deleted.append(name)
        return self.secrets.pop(name, None) is not None


def _counter() -> Any:
    count = iter(range(1000))
    return lambda: f"new-{next(count)}"


def test_resolve_keeps_existing_tokens(pool_body: dict[str, Any]) -> None:
    api = FakeApi(
        {
            "demo-auth": _secret({"peer-token": "peer", "tenants.yaml": "default: x\n"}),
            "demo-tenant-default": _secret({"token": "tok"}),
        }
    )
    got = tokens.resolve_credentials(api, _pool(pool_body), _counter())
    assert got.credentials.peer_token == "peer"
    assert dict(got.credentials.tenant_tokens) == {"default": "tok"}
    assert got.credentials.generated == {"default"}
    assert not got.issued and not got.peer_issued and not got.missing and not got.stale


def test_resolve_generates_missing_and_foreign_tokens(pool_body: dict[str, Any]) -> None:
    # A Secret left by an earlier pool of the same name (another uid) holds no token to keep,
    # nor does one being deleted.
    api = FakeApi(
        {
            "demo-auth": _secret({"peer-token": "old"}, uid="uid-earlier"),
            "demo-tenant-default": _secret({"token": "old"}, deletionTimestamp="2026-01-01"),
        }
    )
    got = tokens.resolve_credentials(api, _pool(pool_body), _counter())
    assert got.credentials.peer_token == "new-0"
    assert dict(got.credentials.tenant_tokens) == {"default": "new-1"}
    assert got.issued == ["default"] and got.peer_issued


def test_resolve_reads_users_secrets_and_finds_removed_tenants(pool_body: dict[str, Any]) -> None:
    pool_body["spec"]["auth"] = {
        "tenants": [
            {"name": "default"},
            {"name": "byo", "secretName": "theirs"},
            {"name": "gone-soon", "secretName": "missing"},
            {"name": "moved", "secretName": "demo-tenant-old"},
        ]
    }
    api = FakeApi(
        {
            "demo-auth": _secret(
                {"peer-token": "p", "tenants.yaml": "default: a\nold: b\nremoved: c\nbyo: d\n"}
            ),
            "demo-tenant-default": _secret({"token": "t"}),
            "theirs": _secret({"token": "user"}, uid=None),
            "demo-tenant-removed": _secret({"token": "r"}),
        }
    )
    pool = _pool(pool_body)
    got = tokens.resolve_credentials(api, pool, _counter())
    assert dict(got.credentials.tenant_tokens) == {"default": "t", "byo": "user"}
    assert got.credentials.generated == {"default"}
    missing, moved = got.missing
    assert "spec.auth.tenants[2].secretName" in missing and "ns1/missing" in missing
    assert "does not exist" in missing
    assert "spec.auth.tenants[3].secretName" in moved
    # "old" is now read from a Secret of the user's that happens to have the generated name:
    # never deleted. "removed" is gone from the spec and "byo" brings its own Secret now:
    # their generated Secrets go (where the pool has one).
    assert got.stale == ["demo-tenant-byo", "demo-tenant-removed"]
    assert tokens.delete_stale(api, pool, got.stale) == ["demo-tenant-removed"]
    # Only Secrets the pool controls are deleted.
    api.secrets["demo-tenant-x"] = _secret({"token": "x"}, uid="someone-else")
    assert tokens.delete_stale(api, pool, ["demo-tenant-x", "absent"]) == []
    assert "demo-tenant-x" in api.secrets
