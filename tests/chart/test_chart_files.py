"""The chart's static files, without a cluster: the values schema and the CRD copies.

The e2e tests (tests/e2e/test_chart.py) render and install the chart; these catch the
cheap mistakes in milliseconds: an invalid schema, defaults the schema refuses, and a
chart CRD that drifted from what ``kvpool crd`` generates.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpool_operator.crd import crd_yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvpool"
SCHEMA_FILE = CHART / "values.schema.json"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return loaded


@pytest.fixture(scope="module")
def defaults() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def errors(schema: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """Schema errors as 'dotted.path: message' (the form helm reports them in)."""
    validator = jsonschema.Draft7Validator(schema)
    return [
        ".".join(str(p) for p in err.absolute_path) + ": " + err.message
        for err in validator.iter_errors(values)
    ]


def with_value(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    *parents, leaf = path.split(".")
    node = out
    for step in parents:
        node = node.setdefault(step, {})
    node[leaf] = value
    return out


def test_schema_is_valid_draft7(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)


def test_defaults_satisfy_schema(schema: dict[str, Any], defaults: dict[str, Any]) -> None:
    assert errors(schema, defaults) == []


def test_every_default_key_is_declared(schema: dict[str, Any], defaults: dict[str, Any]) -> None:
    """additionalProperties: false everywhere a value is structured, so a typo is an error."""
    assert set(defaults) <= set(schema["properties"])
    assert errors(schema, {**defaults, "operatr": {}}) != []
    assert errors(schema, with_value(defaults, "operator.peering.enabld", True)) != []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("operator.replicas", "two"),
        ("operator.replicas", 0),
        ("operator.watchNamespaces", ["Not_A_Namespace"]),
        ("operator.watchNamespaces", "team-a"),
        ("operator.timerInterval", 0),
        ("operator.healthPort", 80),
        ("image.pullPolicy", "Sometimes"),
        ("rbac.create", "yes"),
        ("serviceMonitor.interval", "30 seconds"),
        ("podDisruptionBudget.maxUnavailable", "half"),
        ("resources.limits", {"memory": "lots"}),
        ("operator.clusterWide", "yes"),
        ("operator.allowedImagePrefixes", "ghcr.io/kvpool/"),
        ("operator.allowedImagePrefixes", [""]),
        ("operator.allowedImagePrefixes", ["a b/"]),
        ("operator.allowForeignHandoffPeers", "no"),
        ("networkPolicy.enabled", "on"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(
    schema: dict[str, Any], defaults: dict[str, Any], path: str, value: Any
) -> None:
    found = errors(schema, with_value(defaults, path, value))
    assert found, f"{path}={value!r} was accepted"
    assert any(e.startswith(path) for e in found), found


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("operator.watchNamespaces", ["team-a", "team-b"]),
        ("podDisruptionBudget.minAvailable", "50%"),
        ("podDisruptionBudget.minAvailable", 1),
        ("resources.limits", {"cpu": "500m", "memory": "1Gi"}),
        ("serviceMonitor.interval", "1m30s"),
        ("operator.clusterWide", True),
        ("operator.allowedImagePrefixes", ["ghcr.io/kvpool/", "registry.local:5000/"]),
        ("operator.allowForeignHandoffPeers", True),
        ("networkPolicy.enabled", False),
    ],
)
def test_schema_accepts_good_values(
    schema: dict[str, Any], defaults: dict[str, Any], path: str, value: Any
) -> None:
    assert errors(schema, with_value(defaults, path, value)) == []


def test_defaults_are_namespaced_and_closed(defaults: dict[str, Any]) -> None:
    """The safe defaults the README promises: the release's namespace only, a NetworkPolicy
    for the operator, any image (no prefix list) but only the pools' own handoff peers."""
    operator = defaults["operator"]
    assert operator["watchNamespaces"] == [] and operator["clusterWide"] is False
    assert operator["allowedImagePrefixes"] == []
    assert operator["allowForeignHandoffPeers"] is False
    assert defaults["networkPolicy"] == {"enabled": True}


def test_every_template_is_listed_in_the_readme() -> None:
    readme = (CHART / "README.md").read_text()
    for template in sorted((CHART / "templates").glob("*.yaml")):
        assert f"`templates/{template.name}`" in readme, template.name


def test_chart_crd_is_the_generated_one() -> None:
    """Fix with ``hack/sync-chart-crd.sh`` after changing the operator's models (the
    repository's crds/kvcachepools.yaml has its own check: ``kvpool crd --check``)."""
    assert (CHART / "crds" / "kvcachepools.yaml").read_text() == crd_yaml()


def test_peering_crds_match_what_kopf_watches() -> None:
    """kopf looks for clusterkopfpeerings/kopfpeerings in kopf.dev/v1 (or zalando.org/v1)."""
    docs = [d for d in yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text()) if d]
    found = {
        (d["spec"]["group"], d["spec"]["names"]["plural"], d["spec"]["scope"])
        for d in docs
        if d["kind"] == "CustomResourceDefinition"
    }
    assert found == {
        ("kopf.dev", "clusterkopfpeerings", "Cluster"),
        ("kopf.dev", "kopfpeerings", "Namespaced"),
    }
    for doc in docs:
        (version,) = doc["spec"]["versions"]
        assert version["name"] == "v1" and version["served"] and version["storage"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        # kopf writes one key per operator id into status: it must be kept, not pruned.
        assert status["x-kubernetes-preserve-unknown-fields"] is True
        assert "subresources" not in version  # kopf patches status on the object itself


def test_chart_metadata_versions_match_project() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in pyproject
    assert chart["apiVersion"] == "v2"


def run_sync(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / "hack" / "sync-chart-crd.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable},  # this interpreter, venv active or not
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_sync_script_checks_and_refreshes(tmp_path: Path) -> None:
    """On a copy of the layout: --check passes in sync, fails stale; a plain run fixes it."""
    (tmp_path / "hack").mkdir()
    shutil.copy(REPO / "hack" / "sync-chart-crd.sh", tmp_path / "hack")
    (tmp_path / "crds").mkdir()
    (tmp_path / "charts" / "kvpool" / "crds").mkdir(parents=True)
    generated = crd_yaml()
    (tmp_path / "crds" / "kvcachepools.yaml").write_text(generated)
    chart_crd = tmp_path / "charts" / "kvpool" / "crds" / "kvcachepools.yaml"
    chart_crd.write_text(generated.replace("kvp", "kvx"))

    stale = run_sync(tmp_path, "--check")
    assert stale.returncode == 1 and "charts/kvpool/crds/kvcachepools.yaml" in stale.stderr
    assert run_sync(tmp_path).returncode == 0
    assert chart_crd.read_text() == generated
    assert run_sync(tmp_path, "--check").returncode == 0
