"""The generated CRD on the real API server: schema, CEL rules, subresources, examples.

Each class of invalid manifest must be refused by kube-apiserver itself, with the offending
field named in the error, so ``kubectl apply`` tells users exactly what to fix.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_dev.cluster import DevCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "kvcachepools.yaml"
EXAMPLES = sorted((REPO / "crds" / "examples").glob("*.yaml"))

POOL: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "KVCachePool",
    "metadata": {"name": "valid"},
    "spec": {
        "replicas": 1,
        "model": {"numLayers": 4, "numKvHeads": 2, "headDim": 64},
        "kvCacheConfig": {"tokensPerBlock": 16},
    },
}


@pytest.fixture(scope="module")
def crd(dev_cluster: DevCluster) -> Iterator[DevCluster]:
    """The CRD installed (server-side apply, as the chart's CRD install would) and served."""
    dev_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    dev_cluster.kubectl(
        "wait", "--for=condition=Established", "crd/kvcachepools.kvpool.io", "--timeout=60s"
    )
    yield dev_cluster


def kubectl_apply(
    cluster: DevCluster, tmp_path: Path, doc: dict[str, Any], namespace: str, *extra: str
) -> Any:
    path = tmp_path / f"doc-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return cluster.kubectl("apply", "-n", namespace, "-f", str(path), *extra, check=False)


def edited(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(POOL)
    edit(doc["spec"])
    return doc


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for step in parents:
            node = node.setdefault(step, {})
        node[leaf] = value

    return edit


def _autoscaled(**auto: Any) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        spec.pop("replicas", None)
        spec["autoscaling"] = auto

    return edit


def _replicas_and_builtin(spec: dict[str, Any]) -> None:
    spec["replicas"] = 3
    spec["autoscaling"] = {"mode": "builtin", "minReplicas": 1, "maxReplicas": 4}


INVALID = [
    (
        "tokens-not-power-of-two",
        _set("kvCacheConfig.tokensPerBlock", 24),
        "spec.kvCacheConfig.tokensPerBlock",
        "power of two",
    ),
    (
        "tokens-one",
        _set("kvCacheConfig.tokensPerBlock", 1),
        "spec.kvCacheConfig.tokensPerBlock",
        "",
    ),
    (
        "min-over-max",
        _autoscaled(minReplicas=5, maxReplicas=2),
        "spec.autoscaling.minReplicas",
        "must not exceed maxReplicas",
    ),
    (
        "fraction-above-one",
        _set("kvCacheConfig.freeGpuMemoryFraction", 1.5),
        "spec.kvCacheConfig.freeGpuMemoryFraction",
        "",
    ),
    (
        "fraction-zero",
        _set("kvCacheConfig.freeGpuMemoryFraction", 0),
        "spec.kvCacheConfig.freeGpuMemoryFraction",
        "",
    ),
    (
        "hit-rate-above-one",
        _autoscaled(targetHitRate=1.2, maxReplicas=3),
        "spec.autoscaling.targetHitRate",
        "",
    ),
    (
        "replicas-with-builtin-autoscaling",
        _replicas_and_builtin,
        "spec.replicas",
        "cannot both own the replica count",
    ),
    (
        "heads-per-layer-length",
        _set("model.numKvHeadsPerLayer", [2, 2]),
        "spec.model.numKvHeadsPerLayer",
        "one entry per layer",
    ),
    (
        "max-unavailable-percent",
        _set("rollout.maxUnavailable", "150%"),
        "spec.rollout.maxUnavailable",
        "",
    ),
    (
        "tenant-twice",
        _set("auth.tenants", [{"name": "team-a"}, {"name": "team-a"}]),
        "spec.auth.tenants[1]",
        "Duplicate value",
    ),
    (
        "tenant-not-a-dns-label",
        _set("auth.tenants", [{"name": "Team_A"}]),
        "spec.auth.tenants[0].name",
        "",
    ),
    (
        "client-selector-not-a-map",
        _set("network.clientSelector", "app=vllm"),
        "spec.network.clientSelector",
        "",
    ),
    (
        "usage-thresholds-crossed",
        _autoscaled(scaleUpUsage=0.4, scaleDownUsage=0.6),
        "spec.autoscaling.scaleDownUsage",
        "flap",
    ),
]


@pytest.mark.parametrize(
    ("edit", "field", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_manifest_is_rejected_naming_the_field(
    crd: DevCluster,
    namespace: str,
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    field: str,
    message: str,
) -> None:
    result = kubectl_apply(crd, tmp_path, edited(edit), namespace, "--dry-run=server")
    assert result.returncode != 0, result.stdout
    assert field in result.stderr, result.stderr
    assert message in result.stderr, result.stderr


def test_valid_manifest_is_accepted_with_defaults(
    crd: DevCluster, namespace: str, tmp_path: Path
) -> None:
    result = kubectl_apply(crd, tmp_path, POOL, namespace, "--dry-run=server", "-o", "json")
    assert result.returncode == 0, result.stderr
    obj = json.loads(result.stdout)
    cache = obj["spec"]["kvCacheConfig"]
    assert cache["freeGpuMemoryFraction"] == 0.9 and cache["secondaryOffloadMinPriority"] == 35
    assert obj["spec"]["rollout"]["maxUnavailable"] == 1
    # One tenant named default, and a NetworkPolicy, unless the pool says otherwise.
    assert obj["spec"]["auth"] == {"tenants": [{"name": "default"}]}
    assert obj["spec"]["network"] == {"policy": True}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_accepted(crd: DevCluster, path: Path) -> None:
    result = crd.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
    assert result.returncode == 0, result.stderr


def test_geometry_and_block_size_are_immutable(
    crd: DevCluster, namespace: str, tmp_path: Path
) -> None:
    assert kubectl_apply(crd, tmp_path, POOL, namespace).returncode == 0

    tokens = kubectl_apply(
        crd, tmp_path, edited(_set("kvCacheConfig.tokensPerBlock", 32)), namespace
    )
    assert tokens.returncode != 0
    assert "spec.kvCacheConfig.tokensPerBlock" in tokens.stderr
    assert "immutable" in tokens.stderr

    model = kubectl_apply(crd, tmp_path, edited(_set("model.numLayers", 8)), namespace)
    assert model.returncode != 0
    assert "spec.model" in model.stderr and "immutable" in model.stderr

    live = kubectl_apply(
        crd, tmp_path, edited(_set("kvCacheConfig.enableBlockReuse", False)), namespace
    )
    assert live.returncode == 0, live.stderr


def test_scale_subresource_and_printer_columns(
    crd: DevCluster, namespace: str, tmp_path: Path
) -> None:
    doc = edited(_autoscaled(mode="builtin", minReplicas=1, maxReplicas=4))
    assert kubectl_apply(crd, tmp_path, doc, namespace).returncode == 0
    # The built-in autoscaler moves replicas through /scale once the pool is autoscaled.
    crd.kubectl("scale", "-n", namespace, "kvp/valid", "--replicas=3")
    got = json.loads(crd.kubectl("get", "-n", namespace, "kvp/valid", "-o", "json").stdout)
    assert got["spec"]["replicas"] == 3
    header = crd.kubectl("get", "-n", namespace, "kvcachepools").stdout.splitlines()[0]
    for column in ("REPLICAS", "READY", "UPDATED", "HIT RATE", "AGE"):
        assert column in header


def test_explain_reads_the_descriptions(crd: DevCluster) -> None:
    deadline = time.monotonic() + 30
    while True:  # the OpenAPI document of a new CRD is published after a short delay
        result = crd.kubectl("explain", "kvcachepool.spec.kvCacheConfig", check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert result.returncode == 0, result.stderr
    assert "tokensPerBlock" in result.stdout and "power of two" in result.stdout
