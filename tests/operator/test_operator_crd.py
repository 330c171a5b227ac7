"""The generated CRD: committed file in sync, structural, with the rules and subresources."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kvp_cases import REPO, example_documents
from pydantic import BaseModel

from kvpool_operator.crd import crd_manifest, crd_yaml
from kvpool_operator.models import KVCachePool
from kvpool_operator.schema import SchemaError, at_path, check_structural, structural_schema

CRD_FILE = REPO / "crds" / "kvcachepools.yaml"


def _version() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]


def _spec_schema() -> dict[str, Any]:
    return _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    return list(node.get("x-kubernetes-validations", []))


def test_committed_crd_matches_generator() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), "run `kvpool crd --output crds/kvcachepools.yaml`"


def test_cli_check_flags_a_stale_file(tmp_path) -> None:
    target = tmp_path / "crd.yaml"
    from argparse import Namespace

    from kvpool_operator.commands import crd as command

    assert command.run(Namespace(output=target, check=False, reference=False)) == 0
    assert target.read_text() == crd_yaml()
    assert command.run(Namespace(output=target, check=True, reference=False)) == 0
    target.write_text(target.read_text() + "# edited\n")
    assert command.run(Namespace(output=target, check=True, reference=False)) == 1


def test_kvpool_crd_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool_cli import main

    assert main(["crd"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert docs == [crd_manifest()]


def test_kvpool_operator_flags() -> None:
    from kvpool_cli import build_parser

    args = build_parser().parse_args(["operator", "-n", "a", "-n", "b", "--priority", "100"])
    assert args.namespace == ["a", "b"] and args.priority == 100 and args.standalone is False


def test_names_scope_and_short_name() -> None:
    spec = crd_manifest()["spec"]
    assert spec["group"] == "kvpool.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "KVCachePool"
    assert spec["names"]["shortNames"] == ["kvp"]
    assert _version()["name"] == "v1alpha1"


def test_schema_is_structural_and_described() -> None:
    root = _version()["schema"]["openAPIV3Schema"]
    assert check_structural(root) == []
    spec = root["properties"]["spec"]
    missing = [key for key, sub in spec["properties"].items() if not sub.get("description")]
    assert missing == []
    assert "tokens" in at_path(spec, ("kvCacheConfig", "tokensPerBlock"))["description"].lower()


def test_defaults_come_from_the_models() -> None:
    spec = _spec_schema()
    assert at_path(spec, ("kvCacheConfig", "tokensPerBlock"))["default"] == 32
    assert at_path(spec, ("kvCacheConfig", "freeGpuMemoryFraction"))["default"] == 0.9
    assert at_path(spec, ("kvCacheConfig",))["default"] == {}
    assert at_path(spec, ("autoscaling", "scaleDownStabilizationSeconds"))["default"] == 300
    fraction = at_path(spec, ("kvCacheConfig", "freeGpuMemoryFraction"))
    assert fraction["minimum"] == 0 and fraction["exclusiveMinimum"] is True
    assert fraction["maximum"] == 1 and fraction["exclusiveMaximum"] is True
    assert at_path(spec, ("autoscaling", "targetHitRate"))["maximum"] == 1.0


def test_cel_rules_cover_what_the_schema_cannot_say() -> None:
    spec = _spec_schema()
    tpb = _rules(at_path(spec, ("kvCacheConfig", "tokensPerBlock")))
    assert any("power of two" in r["message"] for r in tpb)
    assert any(r["rule"] == "self == oldSelf" for r in tpb)
    model = _rules(at_path(spec, ("model",)))
    assert any(r["rule"] == "self == oldSelf" for r in model)
    auto = _rules(at_path(spec, ("autoscaling",)))
    assert any(r.get("fieldPath") == ".minReplicas" for r in auto)
    owner = _rules(spec)
    assert owner and owner[0]["fieldPath"] == ".replicas" and owner[0]["optionalOldSelf"]
    for rule in [*tpb, *model, *auto, *owner]:
        assert rule["message"] and rule["reason"].startswith("Field")


def test_int_or_list_heads_split_into_two_fields() -> None:
    model = at_path(_spec_schema(), ("model",))
    assert model["properties"]["numKvHeads"]["type"] == "integer"
    assert model["properties"]["numKvHeadsPerLayer"]["type"] == "array"


def test_status_scale_and_printer_columns() -> None:
    version = _version()
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Replicas", "Ready", "Updated", "Hit rate 5m", "At N-1", "At N+1", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize(("name", "doc"), example_documents(), ids=lambda v: str(v)[:30])
def test_examples_parse_with_the_models(name: str, doc: dict[str, Any]) -> None:
    pool = KVCachePool.model_validate(doc)
    config = pool.spec.agent_config()
    assert config.model.num_layers == pool.spec.model.num_layers


def test_examples_exist() -> None:
    assert len(example_documents()) >= 3


class _Union(BaseModel):
    value: int | list[int]


class _Optional(BaseModel):
    count: int | None = None
    size: int | str = 1


def test_converter_rejects_unions_without_a_structural_form() -> None:
    with pytest.raises(SchemaError, match="value"):
        structural_schema(_Union)


def test_converter_maps_optional_and_int_or_string() -> None:
    schema = structural_schema(_Optional)
    assert schema["properties"]["count"] == {"type": "integer"}
    size = schema["properties"]["size"]
    assert size["x-kubernetes-int-or-string"] is True and size["default"] == 1
    assert check_structural(schema) == []
