"""Turn pydantic JSON schemas into Kubernetes structural OpenAPI v3 schemas.

The API server only accepts *structural* schemas: every field has a type, no ``$ref``, no
type inside ``anyOf``, ``nullable`` instead of a ``null`` type, boolean ``exclusiveMinimum``.
Pydantic emits JSON Schema 2020-12, so this module rewrites one into the other and then
lays the CEL rules of ``kvpool_operator.rules`` on top, at the field each rule is about.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

JsonSchema = dict[str, Any]

_DROPPED_KEYS = frozenset({"title", "additionalProperties", "$defs", "examples"})


class SchemaError(ValueError):
    """A pydantic schema construct with no structural equivalent; names the JSON path."""


def structural_schema(model: type[BaseModel]) -> JsonSchema:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase, by alias)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    return _convert(raw, defs, path="")


def _resolve(node: Mapping[str, Any], defs: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Inline a ``$ref`` (or a single-element ``allOf`` of one), keeping sibling keys."""
    node = dict(node)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    if "$ref" in node:
        ref = node.pop("$ref")
        name = ref.rsplit("/", 1)[-1]
        if name not in defs:
            raise SchemaError(f"{path or '(root)'}: unknown reference {ref}")
        target = _resolve(defs[name], defs, path)
        node = {**target, **node}  # the field's own description/default win over the model's
    return node


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], path: str) -> JsonSchema:
    node = _resolve(node, defs, path)
    out: JsonSchema = {}

    any_of = node.get("anyOf")
    if any_of is not None:
        variants = [_resolve(v, defs, path) for v in any_of]
        # ``X | None`` becomes plain X: the API server prunes nulls of non-nullable fields, so an
        # optional field is simply absent, and CEL rules never meet a null.
        non_null = [v for v in variants if v.get("type") != "null"]
        types = sorted(str(v.get("type")) for v in non_null)
        if len(non_null) == 1:
            inner = _convert(non_null[0], defs, path)
            merged = {k: v for k, v in node.items() if k != "anyOf"}
            out = {**inner, **_convert_scalars(merged)}
            return _ordered(out)
        if types == ["integer", "string"]:
            out = _convert_scalars({k: v for k, v in node.items() if k != "anyOf"})
            out["x-kubernetes-int-or-string"] = True
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
            return _ordered(out)
        raise SchemaError(
            f"{path or '(root)'}: a union of {types} has no structural schema; "
            "split it into separate fields"
        )

    out = _convert_scalars(node)
    kind = out.get("type")
    if kind is None and "enum" not in out:
        raise SchemaError(f"{path or '(root)'}: no type")
    if kind == "object":
        props = node.get("properties", {})
        if props:
            out["properties"] = {
                key: _convert(value, defs, f"{path}.{key}") for key, value in props.items()
            }
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping) and not props:
            out["additionalProperties"] = _convert(extra, defs, f"{path}[*]")
        if node.get("required"):
            out["required"] = list(node["required"])
    elif kind == "array":
        out["items"] = _convert(node.get("items", {}), defs, f"{path}[*]")
    return _ordered(out)


_FIRST = ("type", "description", "default")
_LAST = ("required", "properties", "additionalProperties", "items")


def _ordered(node: JsonSchema) -> JsonSchema:
    """Type and description first, nested schemas last: the YAML reads top-down."""
    head = {k: node[k] for k in _FIRST if k in node}
    tail = {k: node[k] for k in _LAST if k in node}
    middle = {k: v for k, v in node.items() if k not in head and k not in tail}
    return {**head, **middle, **tail}


def _convert_scalars(node: Mapping[str, Any]) -> JsonSchema:
    """Copy the keys that need no recursion, rewriting the ones OpenAPI v3 spells differently."""
    out: JsonSchema = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS or key in ("properties", "items", "required", "anyOf"):
            continue
        if key == "exclusiveMinimum" and node.get("type") == "integer":
            out["minimum"] = int(value) + 1  # the plain bound reads better for integers
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "default" and value is None:
            continue
        else:
            out[key] = copy.deepcopy(value)
    if "enum" in out and "type" not in out:
        values = out["enum"]
        if all(isinstance(v, str) for v in values):
            out["type"] = "string"
    return out


def at_path(schema: JsonSchema, path: Sequence[str]) -> JsonSchema:
    """The sub-schema of a dotted property path (``[*]`` steps into array items)."""
    node = schema
    for step in path:
        if step == "[*]":
            node = node["items"]
        else:
            try:
                node = node["properties"][step]
            except KeyError:
                raise SchemaError(f"no property {'.'.join(path)} in the schema") from None
    return node


def overlay(schema: JsonSchema, patches: Mapping[tuple[str, ...], Mapping[str, Any]]) -> None:
    """Merge extra keys (CEL rules, bounds) into the schema at each path; lists are extended."""
    for path, extra in patches.items():
        node = at_path(schema, path)
        for key, value in extra.items():
            if isinstance(value, list) and isinstance(node.get(key), list):
                node[key] = [*node[key], *copy.deepcopy(value)]
            else:
                node[key] = copy.deepcopy(value)
        ordered = _ordered(node)
        node.clear()
        node.update(ordered)


def check_structural(schema: JsonSchema, path: str = "") -> list[str]:
    """The structural-schema rules this generator must keep; returns one line per violation.

    A fast local stand-in for the API server's check (the e2e tests run the real one).
    """
    problems: list[str] = []
    where = path or "(root)"
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    if "type" not in schema and not (preserve or int_or_string):
        problems.append(f"{where}: no type")
    for key in ("$ref", "$defs", "const", "title"):
        if key in schema:
            problems.append(f"{where}: {key} is not allowed")
    for junctor in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(junctor, []):
            for banned in ("type", "description", "default", "nullable", "additionalProperties"):
                if banned in branch and not (int_or_string and banned == "type"):
                    problems.append(f"{where}: {banned} inside {junctor}")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema and not isinstance(schema[key], bool):
            problems.append(f"{where}: {key} must be a boolean")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}: properties and additionalProperties together")
    if schema.get("default", 0) is None:
        problems.append(f"{where}: null default")
    for key, sub in schema.get("properties", {}).items():
        problems.extend(check_structural(sub, f"{path}.{key}"))
    if isinstance(schema.get("additionalProperties"), dict):
        problems.extend(check_structural(schema["additionalProperties"], f"{path}[*]"))
    if "items" in schema:
        problems.extend(check_structural(schema["items"], f"{path}[*]"))
    return problems
