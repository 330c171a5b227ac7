"""Pool manifests and example documents shared by the operator unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "crds" / "examples"

BASE_POOL: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "KVCachePool",
    "metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1234", "generation": 1},
    "spec": {
        "replicas": 2,
        "model": {"name": "m", "numLayers": 4, "numKvHeads": 2, "headDim": 64},
        "kvCacheConfig": {"tokensPerBlock": 16},
        "pod": {
            "image": "registry.local/kvpool:test",
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "nodeSelector": {"gpu": "yes"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    },
}


def pool_manifest() -> dict[str, Any]:
    """A fresh copy of a valid pool manifest (edit it freely)."""
    return copy.deepcopy(BASE_POOL)


def example_documents() -> list[tuple[str, dict[str, Any]]]:
    """Every KVCachePool document under crds/examples/, with its file name."""
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCachePool":
                docs.append((path.name, doc))
    return docs
