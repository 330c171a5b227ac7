"""The kopf handlers against kmock's Kubernetes emulator (no cluster, fast).

Handlers are called as kopf calls them (keyword arguments, sync, in a worker thread); the
mock server stores what they apply, so the tests read back children, status and events.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from collections.abc import AsyncIterator
from typing import Any, cast

import kmock
import kopf
import pytest
import pytest_asyncio
import yaml
from kube_mock import ApplyingEmulator

from kvpool_agent.credentials import parse_tenants, token_digest
from kvpool_operator import handlers
from kvpool_operator.kube import KubeApi
from kvpool_operator.metrics import ScrapeTarget
from kvpool_operator.models import CONFIG_HASH_ANNOTATION
from kvpool_operator.policy import OperatorPolicy
from kvpool_operator.reconcile import OperatorContext

POOLS = "kvpool.io/v1alpha1/kvcachepools"
STS = "apps/v1/statefulsets"
CMS = "v1/configmaps"
SECRETS = "v1/secrets"
NETPOLS = "networking.k8s.io/v1/networkpolicies"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture
async def kube() -> AsyncIterator[ApplyingEmulator]:
    async with ApplyingEmulator() as mock, kmock.Server(mock):
        for res in (
            POOLS,
            STS,
            CMS,
            "v1/services",
            "policy/v1/poddisruptionbudgets",
            "v1/pods",
            "v1/events",
            SECRETS,
            NETPOLS,
        ):
            mock.resources[res] = {}
        yield mock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def memo(kube: ApplyingEmulator, clock: FakeClock) -> kopf.Memo:
    memo = kopf.Memo()
    memo[handlers.CONTEXT_KEY] = OperatorContext(
        api=KubeApi.for_host(str(kube.url).rstrip("/")), clock=clock
    )
    return memo


async def store(kube: ApplyingEmulator, body: dict[str, Any]) -> dict[str, Any]:
    """Put the pool in the mock API (as a user's kubectl apply would) and return it."""
    meta = body["metadata"]
    key = (kmock.resource(POOLS), meta["namespace"], meta["name"])
    kube.objects[key] = copy.deepcopy(body)
    return kube.object(POOLS, meta["namespace"], meta["name"]) or {}


async def run(handler: Any, memo: kopf.Memo, body: dict[str, Any]) -> None:
    await asyncio.to_thread(handler, memo=memo, body=kopf.Body(cast(Any, body)), logger=None)


async def pool_after(kube: ApplyingEmulator, body: dict[str, Any]) -> dict[str, Any]:
    obj = kube.object(POOLS, body["metadata"]["namespace"], body["metadata"]["name"])
    assert obj is not None
    return obj


def reasons(kube: ApplyingEmulator) -> list[str]:
    return [e["reason"] for e in kube.events("ns1")]


def sts_hash(kube: ApplyingEmulator) -> str:
    sts = kube.object(STS, "ns1", "demo")
    assert sts is not None
    return str(sts["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


@pytest.mark.asyncio
async def test_create_applies_children_status_and_an_event(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)

    for res, name in [
        (CMS, "demo-agent-config"),
        (STS, "demo"),
        ("v1/services", "demo"),
        ("policy/v1/poddisruptionbudgets", "demo"),
    ]:
        child = kube.object(res, "ns1", name)
        assert child is not None, res
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"

    applies = [r for r in kube.requests if r.method == "PATCH" and "fieldManager" in r.params]
    assert applies and all(r.params["fieldManager"] == "kvpool-operator" for r in applies)
    assert all(r.params["force"] == "true" for r in applies)

    status = (await pool_after(kube, body))["status"]
    assert status["observedGeneration"] == 1
    assert status["selector"] == (
        "app.kubernetes.io/instance=demo,app.kubernetes.io/name=kvpool-agent"
    )
    assert status["configHash"] == sts_hash(kube)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False"  # no pods yet
    assert conditions["Progressing"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert reasons(kube) == ["Created"]


@pytest.mark.asyncio
async def test_resume_is_idempotent(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    body = await pool_after(kube, body)
    before = {r: kube.object(r, "ns1", n) for r, n in [(STS, "demo"), (CMS, "demo-agent-config")]}
    status_patches = len([r for r in kube.requests if r.url.path.endswith("/status")])
    await run(handlers.on_change, memo, body)
    after = {r: kube.object(r, "ns1", n) for r, n in [(STS, "demo"), (CMS, "demo-agent-config")]}
    assert before == after
    assert reasons(kube) == ["Created"]  # nothing new to report
    assert len([r for r in kube.requests if r.url.path.endswith("/status")]) == status_patches


@pytest.mark.asyncio
async def test_live_change_only_touches_the_configmap(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    old_hash = sts_hash(kube)
    old_cm = kube.object(CMS, "ns1", "demo-agent-config")

    pool_body["spec"]["kvCacheConfig"]["enableBlockReuse"] = False
    pool_body["metadata"]["generation"] = 2
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)

    assert sts_hash(kube) == old_hash
    new_cm = kube.object(CMS, "ns1", "demo-agent-config")
    assert old_cm is not None and new_cm is not None
    assert "enable_block_reuse: false" in new_cm["data"]["agent.yaml"]
    assert reasons(kube) == ["Created", "ConfigReloaded"]
    assert (await pool_after(kube, body))["status"]["observedGeneration"] == 2


@pytest.mark.asyncio
async def test_restart_change_rolls_the_pods(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    old_hash = sts_hash(kube)

    pool_body["spec"]["kvCacheConfig"]["hostCacheSize"] = 1 << 30
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)

    assert sts_hash(kube) != old_hash
    event = next(e for e in kube.events("ns1") if e["reason"] == "RollingRestart")
    assert "kv_cache_config.host_cache_size" in event["message"]
    assert (await pool_after(kube, body))["status"]["configHash"] == sts_hash(kube)


@pytest.mark.asyncio
async def test_rollout_progress_and_ready(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    key = (kmock.resource(STS), "ns1", "demo")
    kube.objects[key].patch(
        {
            "metadata": {"generation": 1},
            "status": {
                "observedGeneration": 1,
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 1,
                "currentRevision": "a",
                "updateRevision": "b",
            },
        }
    )
    body = await pool_after(kube, body)
    await run(handlers.on_change, memo, body)
    conditions = {c["type"]: c for c in (await pool_after(kube, body))["status"]["conditions"]}
    assert conditions["Progressing"]["reason"] == "RollingUpdate"
    assert conditions["Ready"]["status"] == "False"  # ready pods, but not the updated ones

    kube.objects[key].patch({"status": {"updatedReplicas": 2, "currentRevision": "b"}})
    body = await pool_after(kube, body)
    await run(handlers.on_change, memo, body)
    status = (await pool_after(kube, body))["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["status"] == "False"
    assert status["readyReplicas"] == 2 and status["updatedReplicas"] == 2


@pytest.mark.asyncio
async def test_invalid_spec_is_reported_not_applied(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["kvCacheConfig"]["tokensPerBlock"] = 24
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    await run(handlers.on_change, memo, await pool_after(kube, body))

    assert kube.object(STS, "ns1", "demo") is None
    (event,) = [e for e in kube.events("ns1") if e["reason"] == "InvalidSpec"]  # posted once
    assert event["type"] == "Warning"
    assert "spec.kvCacheConfig.tokensPerBlock" in event["message"]
    conditions = {c["type"]: c for c in (await pool_after(kube, body))["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Degraded"]["reason"] == "InvalidSpec"


@pytest.mark.asyncio
async def test_servicemonitor_without_its_crd_warns_and_skips(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["monitoring"] = {"serviceMonitor": True}
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    assert "ServiceMonitorUnavailable" in reasons(kube)
    assert kube.object(STS, "ns1", "demo") is not None


@pytest.mark.asyncio
async def test_servicemonitor_applied_when_its_crd_exists(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    kube.resources["monitoring.coreos.com/v1/servicemonitors"] = {}
    pool_body["spec"]["monitoring"] = {"serviceMonitor": True}
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    assert kube.object("monitoring.coreos.com/v1/servicemonitors", "ns1", "demo") is not None
    assert "ServiceMonitorUnavailable" not in reasons(kube)


def _metrics(queries: float, hits: float, capacity: float, used: int) -> str:
    return (
        f"kvpool_prefix_cache_queries_tokens_total {queries}\n"
        f'kvpool_prefix_cache_hits_tokens_total{{tier="primary"}} {hits}\n'
        f"kvpool_prefix_cache_capacity_misses_tokens_total {capacity}\n"
        f'kvpool_cache_blocks_used{{pool="p0",tier="primary"}} {used}\n'
        f'kvpool_cache_blocks_total{{pool="p0",tier="primary"}} 100\n'
    )


@pytest.mark.asyncio
async def test_timer_scales_through_the_scale_subresource(
    kube: ApplyingEmulator, memo: kopf.Memo, clock: FakeClock, pool_body: dict[str, Any]
) -> None:
    del pool_body["spec"]["replicas"]
    pool_body["spec"]["autoscaling"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "scaleUpStabilizationSeconds": 0,
    }
    for i in range(2):
        kube.objects[kmock.resource("v1/pods"), "ns1", f"demo-{i}"] = {
            "metadata": {
                "name": f"demo-{i}",
                "namespace": "ns1",
                "labels": {"app.kubernetes.io/instance": "demo"},
            },
            "status": {"phase": "Running", "podIP": f"127.0.0.{i + 2}"},
        }
    scraped: list[ScrapeTarget] = []
    totals = {"q": 0.0, "h": 0.0, "c": 0.0}

    def scraper(target: ScrapeTarget) -> str:
        scraped.append(target)
        return _metrics(totals["q"], totals["h"], totals["c"], used=97)

    ctx = memo[handlers.CONTEXT_KEY]
    ctx.scraper = scraper
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    await run(handlers.on_timer, memo, await pool_after(kube, body))  # first scrape: baseline
    assert kube.object(POOLS, "ns1", "demo")["spec"].get("replicas") is None

    totals.update(q=10_000, h=4_000, c=5_000)  # hit rate 0.4, capacity misses 83% of misses
    clock.now += 10
    await run(handlers.on_timer, memo, await pool_after(kube, body))

    scale = [r for r in kube.requests if r.url.path.endswith("/scale")]
    assert len(scale) == 1 and scale[0].data == {"spec": {"replicas": 2}}
    assert kube.object(STS, "ns1", "demo")["spec"]["replicas"] == 2
    assert "ScaledUp" in reasons(kube)
    assert {t.url for t in scraped} >= {"http://127.0.0.2:8000/metrics"}

    status = (await pool_after(kube, body))["status"]
    assert status["cache"]["hitRate"] == pytest.approx(0.4)
    assert status["cache"]["usage"] == pytest.approx(0.97)
    assert "lastScaleTime" in status


@pytest.mark.asyncio
async def test_external_mode_leaves_replicas_alone(
    kube: ApplyingEmulator, memo: kopf.Memo, clock: FakeClock, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["autoscaling"] = {"mode": "external", "maxReplicas": 8}
    memo[handlers.CONTEXT_KEY].scraper = lambda _t: _metrics(0, 0, 0, 99)
    body = await store(kube, pool_body)
    for _ in range(3):
        await run(handlers.on_timer, memo, await pool_after(kube, body))
        clock.now += 60
    assert not [r for r in kube.requests if r.url.path.endswith("/scale")]
    assert kube.object(STS, "ns1", "demo")["spec"]["replicas"] == 2


@pytest.mark.asyncio
async def test_apply_failure_is_retried_and_marks_degraded(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    kube["patch", kmock.resource(STS)] << kmock.KubernetesError(
        status=422, reason="Invalid", message="spec.template: boom"
    )
    body = await store(kube, pool_body)
    with pytest.raises(kopf.TemporaryError):
        await run(handlers.on_change, memo, body)
    conditions = {c["type"]: c for c in (await pool_after(kube, body))["status"]["conditions"]}
    assert conditions["Degraded"]["reason"] == "ApplyFailed"
    assert "ApplyFailed" in reasons(kube)


@pytest.mark.asyncio
async def test_unreachable_agents_leave_no_cache_figures(
    kube: ApplyingEmulator, memo: kopf.Memo, clock: FakeClock, pool_body: dict[str, Any]
) -> None:
    kube.objects[kmock.resource("v1/pods"), "ns1", "demo-0"] = {
        "metadata": {"name": "demo-0", "namespace": "ns1"},
        "status": {"phase": "Running", "podIP": "127.0.0.9"},
    }

    def refuse(_target: ScrapeTarget) -> str:
        raise ConnectionRefusedError("connection refused")

    memo[handlers.CONTEXT_KEY].scraper = refuse
    body = await store(kube, pool_body)
    for _ in range(3):
        await run(handlers.on_timer, memo, await pool_after(kube, body))
        clock.now += 40
    status = (await pool_after(kube, body))["status"]
    assert "cache" not in status and status["observedGeneration"] == 1


@pytest.mark.asyncio
async def test_replicas_beyond_new_bounds_are_written_back_clamped(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    """maxReplicas lowered under an autoscaled pool: spec.replicas follows through /scale."""
    pool_body["spec"]["replicas"] = 5
    pool_body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    memo[handlers.CONTEXT_KEY].scraper = lambda _t: _metrics(0, 0, 0, 50)
    body = await store(kube, pool_body)
    await run(handlers.on_timer, memo, body)
    scale = [r for r in kube.requests if r.url.path.endswith("/scale")]
    assert [r.data for r in scale] == [{"spec": {"replicas": 3}}]
    assert kube.object(STS, "ns1", "demo")["spec"]["replicas"] == 3
    assert "ScaledDown" in reasons(kube)


def test_kopf_bookkeeping_uses_the_kvpool_prefix() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure_settings(settings)
    assert settings.persistence.finalizer == "kvpool.io/finalizer"
    progress = settings.persistence.progress_storage
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert progress.prefix == "kvpool.io"
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == "kvpool.io"


@pytest.mark.asyncio
async def test_delete_forgets_the_pools_memory(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    ctx = memo[handlers.CONTEXT_KEY]
    assert "uid-1234" in ctx.runtimes
    await run(handlers.on_delete, memo, body)
    assert "uid-1234" not in ctx.runtimes


@pytest.mark.asyncio
async def test_a_pool_being_deleted_is_left_to_the_garbage_collector(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    body = await store(kube, pool_body)
    await run(handlers.on_timer, memo, body)
    assert kube.object(STS, "ns1", "demo") is None


# -- credentials, NetworkPolicy and the operator's bounds on pools ---------------------------


def secret_data(kube: ApplyingEmulator, name: str, key: str) -> str | None:
    secret = kube.object(SECRETS, "ns1", name)
    if secret is None:
        return None
    return base64.b64decode(secret["data"][key]).decode()


def agent_tenants(kube: ApplyingEmulator) -> dict[str, str]:
    """The agents' view: token digest -> tenant, as they parse the mounted file."""
    text = secret_data(kube, "demo-auth", "tenants.yaml")
    assert text is not None
    return parse_tenants(text, "demo-auth")


def degraded(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


async def delete_secret(memo: kopf.Memo, name: str) -> None:
    api: KubeApi = memo[handlers.CONTEXT_KEY].api
    assert await asyncio.to_thread(api.delete, "v1", "Secret", "ns1", name)


@pytest.mark.asyncio
async def test_tokens_are_generated_once_and_kept(
    kube: ApplyingEmulator, memo: kopf.Memo, clock: FakeClock, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    token = secret_data(kube, "demo-tenant-default", "token")
    peer = secret_data(kube, "demo-auth", "peer-token")
    assert token and peer and token != peer
    assert agent_tenants(kube) == {token_digest(token): "default"}
    for name in ("demo-tenant-default", "demo-auth"):
        secret = kube.object(SECRETS, "ns1", name)
        assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    policy = kube.object(NETPOLS, "ns1", "demo")
    assert policy is not None and policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    cm = kube.object(CMS, "ns1", "demo-agent-config")
    assert cm is not None and token not in cm["data"]["agent.yaml"]
    old_hash = sts_hash(kube)

    for _ in range(3):  # timer passes and a resume: the same tokens every time
        await run(handlers.on_timer, memo, await pool_after(kube, body))
        clock.now += 30
    await run(handlers.on_change, memo, await pool_after(kube, body))
    assert secret_data(kube, "demo-tenant-default", "token") == token
    assert secret_data(kube, "demo-auth", "peer-token") == peer
    assert sts_hash(kube) == old_hash
    assert reasons(kube) == ["Created"]
    created = next(e for e in kube.events("ns1") if e["reason"] == "Created")
    assert "demo-auth" in created["message"] and "demo-tenant-default" in created["message"]


@pytest.mark.asyncio
async def test_a_deleted_tenant_secret_comes_back_with_a_new_token(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    old_token = secret_data(kube, "demo-tenant-default", "token")
    peer = secret_data(kube, "demo-auth", "peer-token")
    old_hash = sts_hash(kube)

    await delete_secret(memo, "demo-tenant-default")  # how a user rotates a tenant's token
    await run(handlers.on_change, memo, await pool_after(kube, body))
    new_token = secret_data(kube, "demo-tenant-default", "token")
    assert new_token and new_token != old_token
    assert agent_tenants(kube) == {token_digest(new_token): "default"}  # the old one revoked
    assert secret_data(kube, "demo-auth", "peer-token") == peer
    assert sts_hash(kube) == old_hash  # no pod rolls: agents re-read the mounted Secret
    (event,) = [e for e in kube.events("ns1") if e["reason"] == "TokenIssued"]
    assert "default" in event["message"] and "demo-tenant-default" in event["message"]

    await delete_secret(memo, "demo-auth")  # the peer token too
    await run(handlers.on_change, memo, await pool_after(kube, body))
    assert secret_data(kube, "demo-auth", "peer-token") not in (None, peer)
    assert secret_data(kube, "demo-tenant-default", "token") == new_token
    assert "PeerTokenIssued" in reasons(kube)


@pytest.mark.asyncio
async def test_tenants_come_and_go_without_rolling_the_pods(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    default = secret_data(kube, "demo-tenant-default", "token")
    old_hash = sts_hash(kube)

    pool_body["spec"]["auth"] = {"tenants": [{"name": "default"}, {"name": "team-b"}]}
    pool_body["metadata"]["generation"] = 2
    await run(handlers.on_change, memo, await store(kube, pool_body))
    first_b = secret_data(kube, "demo-tenant-team-b", "token")
    assert first_b and secret_data(kube, "demo-tenant-default", "token") == default
    assert agent_tenants(kube) == {
        token_digest(default or ""): "default",
        token_digest(first_b): "team-b",
    }

    pool_body["spec"]["auth"] = {"tenants": [{"name": "default"}]}
    pool_body["metadata"]["generation"] = 3
    await run(handlers.on_change, memo, await store(kube, pool_body))
    assert kube.object(SECRETS, "ns1", "demo-tenant-team-b") is None
    assert list(agent_tenants(kube).values()) == ["default"]
    (revoked,) = [e for e in kube.events("ns1") if e["reason"] == "TenantRevoked"]
    assert "demo-tenant-team-b" in revoked["message"]

    pool_body["spec"]["auth"] = {"tenants": [{"name": "default"}, {"name": "team-b"}]}
    pool_body["metadata"]["generation"] = 4
    await run(handlers.on_change, memo, await store(kube, pool_body))
    assert secret_data(kube, "demo-tenant-team-b", "token") not in (None, first_b)
    assert sts_hash(kube) == old_hash
    assert "RollingRestart" not in reasons(kube)


@pytest.mark.asyncio
async def test_a_tenant_with_its_own_secret(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["auth"] = {
        "tenants": [{"name": "default"}, {"name": "byo", "secretName": "byo-token"}]
    }
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    await run(handlers.on_change, memo, await pool_after(kube, body))
    # The rest is applied; the tenant is left out until its Secret exists.
    assert kube.object(STS, "ns1", "demo") is not None
    assert list(agent_tenants(kube).values()) == ["default"]
    assert kube.object(SECRETS, "ns1", "demo-tenant-byo") is None
    cond = degraded((await pool_after(kube, body))["status"])
    assert cond["status"] == "True" and cond["reason"] == "TenantSecretMissing"
    assert "spec.auth.tenants[1].secretName" in cond["message"] and "byo-token" in cond["message"]
    (event,) = [e for e in kube.events("ns1") if e["reason"] == "TenantSecretMissing"]
    assert event["type"] == "Warning"

    kube.objects[kmock.resource(SECRETS), "ns1", "byo-token"] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "byo-token", "namespace": "ns1"},
        "data": {"token": base64.b64encode(b"users-own-token\n").decode()},
    }
    await run(handlers.on_change, memo, await pool_after(kube, body))
    assert agent_tenants(kube)[token_digest("users-own-token")] == "byo"
    assert degraded((await pool_after(kube, body))["status"])["status"] == "False"
    user = kube.object(SECRETS, "ns1", "byo-token")
    assert user is not None and "ownerReferences" not in user["metadata"]  # never written


@pytest.mark.asyncio
async def test_a_disallowed_image_is_refused_not_applied(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    memo[handlers.CONTEXT_KEY].policy = OperatorPolicy(allowed_image_prefixes=("ghcr.io/kvpool/",))
    body = await store(kube, pool_body)  # image registry.local/kvpool:test
    await run(handlers.on_change, memo, body)
    await run(handlers.on_timer, memo, await pool_after(kube, body))
    assert kube.object(STS, "ns1", "demo") is None
    assert kube.object(SECRETS, "ns1", "demo-auth") is None
    cond = degraded((await pool_after(kube, body))["status"])
    assert cond["status"] == "True" and cond["reason"] == "ImageNotAllowed"
    (event,) = [e for e in kube.events("ns1") if e["reason"] == "ImageNotAllowed"]  # once
    assert event["type"] == "Warning" and "spec.pod.image" in event["message"]
    assert "ghcr.io/kvpool/" in event["message"]

    pool_body["spec"]["pod"]["image"] = "ghcr.io/kvpool/kvpool:0.1.0"
    pool_body["metadata"]["generation"] = 2
    await run(handlers.on_change, memo, await store(kube, pool_body))
    assert kube.object(STS, "ns1", "demo") is not None
    assert degraded((await pool_after(kube, body))["status"])["status"] == "False"


@pytest.mark.asyncio
async def test_a_foreign_handoff_peer_is_refused_unless_allowed(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["agent"] = {
        "lifecycle": {"handoffPeers": ["http://demo-1.demo.ns1.svc:8000", "http://evil:8000"]}
    }
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    assert kube.object(STS, "ns1", "demo") is None
    cond = degraded((await pool_after(kube, body))["status"])
    assert cond["reason"] == "HandoffPeerNotAllowed"
    assert "spec.agent.lifecycle.handoffPeers[1]" in cond["message"]
    assert "HandoffPeerNotAllowed" in reasons(kube)

    memo[handlers.CONTEXT_KEY].policy = OperatorPolicy(allow_foreign_handoff_peers=True)
    await run(handlers.on_change, memo, await pool_after(kube, body))
    assert kube.object(STS, "ns1", "demo") is not None
    assert degraded((await pool_after(kube, body))["status"])["status"] == "False"


@pytest.mark.asyncio
async def test_a_node_socket_is_refused_unless_allowed_then_mounted_one_agent_per_node(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    pool_body["spec"]["pod"]["nodeSocket"] = True
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    assert kube.object(STS, "ns1", "demo") is None
    cond = degraded((await pool_after(kube, body))["status"])
    assert cond["reason"] == "NodeSocketNotAllowed"
    assert "spec.pod.nodeSocket" in cond["message"] and "--allow-node-sockets" in cond["message"]

    memo[handlers.CONTEXT_KEY].policy = OperatorPolicy(allow_node_sockets=True)
    await run(handlers.on_change, memo, await pool_after(kube, body))
    sts = kube.object(STS, "ns1", "demo")
    assert sts is not None
    spec = sts["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "node-socket"]
    assert volume["hostPath"] == {"path": "/var/run/kvpool/ns1/demo", "type": "DirectoryOrCreate"}
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["runAsUser"] == 0
    (agent,) = spec["containers"]
    assert {"name": "node-socket", "mountPath": "/var/run/kvpool-node"} in agent["volumeMounts"]
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # the agent: none
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    cm = kube.object(CMS, "ns1", "demo-agent-config")
    assert cm is not None
    config = yaml.safe_load(cm["data"]["agent.yaml"])
    assert config["transfer"]["unix_socket"] == "/var/run/kvpool-node/transfer.sock"
    assert config["transfer"]["unix_socket_mode"] == 0o660
    assert degraded((await pool_after(kube, body))["status"])["status"] == "False"


@pytest.mark.asyncio
async def test_network_policy_follows_the_spec_and_admits_the_operator(
    kube: ApplyingEmulator, memo: kopf.Memo, pool_body: dict[str, Any]
) -> None:
    memo[handlers.CONTEXT_KEY].policy = OperatorPolicy(
        operator_namespace="kvpool-system", operator_pod_labels={"app.kubernetes.io/name": "kvpool"}
    )
    body = await store(kube, pool_body)
    await run(handlers.on_change, memo, body)
    policy = kube.object(NETPOLS, "ns1", "demo")
    assert policy is not None
    sources = policy["spec"]["ingress"][0]["from"]
    assert {"kubernetes.io/metadata.name": "kvpool-system"} in [
        s.get("namespaceSelector", {}).get("matchLabels") for s in sources
    ]

    pool_body["spec"]["network"] = {"policy": False}
    pool_body["metadata"]["generation"] = 2
    await run(handlers.on_change, memo, await store(kube, pool_body))
    assert kube.object(NETPOLS, "ns1", "demo") is None
    assert "NetworkPolicyRemoved" in reasons(kube)
    await run(handlers.on_change, memo, await pool_after(kube, body))
    assert reasons(kube).count("NetworkPolicyRemoved") == 1
