"""What the CRD checks on the API server beyond field types: CEL rules and extra bounds.

Every rule sits on the field it is about (or names it with ``fieldPath``), so an error from
``kubectl apply`` points at the field. The pydantic models check the same things again when
the operator parses a pool, for clusters that run the CRD without these rules.
"""

from __future__ import annotations

from typing import Any

from kvpool_agent.config import EVICTION_POLICIES

MAX_TOKENS_PER_BLOCK = 1 << 16
POWERS_OF_TWO = [1 << k for k in range(1, 17)]
MAX_LAYERS = 1024


def _rule(rule: str, message: str, reason: str = "FieldValueInvalid", **extra: Any) -> dict:
    return {"rule": rule, "message": message, "reason": reason, **extra}


_IMMUTABLE = "FieldValueForbidden"

SPEC_RULES: dict[tuple[str, ...], dict[str, Any]] = {
    (): {
        "x-kubernetes-validations": [
            _rule(
                "!has(self.replicas) || !has(self.autoscaling)"
                " || self.autoscaling.mode != 'builtin'"
                " || (oldSelf.hasValue() && has(oldSelf.value().autoscaling)"
                " && oldSelf.value().autoscaling.mode == 'builtin')",
                "replicas and built-in autoscaling cannot both own the replica count: drop "
                "spec.replicas, or set spec.autoscaling.mode to external",
                _IMMUTABLE,
                fieldPath=".replicas",
                optionalOldSelf=True,
            )
        ]
    },
    ("kvCacheConfig", "tokensPerBlock"): {
        "minimum": 2,
        "maximum": MAX_TOKENS_PER_BLOCK,
        "x-kubernetes-validations": [
            _rule(
                f"self in {POWERS_OF_TWO}",
                "tokensPerBlock must be a power of two greater than 1 (2, 4, 8, ... 65536)",
            ),
            _rule(
                "self == oldSelf",
                "tokensPerBlock is immutable: the cache layout depends on it; create a new pool",
                _IMMUTABLE,
            ),
        ],
    },
    ("kvCacheConfig", "maxAttentionWindow"): {"maxItems": MAX_LAYERS},
    ("kvCacheConfig", "maxAttentionWindow", "[*]"): {"minimum": 1},
    ("kvCacheConfig", "evictionPolicy"): {"enum": list(EVICTION_POLICIES)},
    ("model",): {
        "x-kubernetes-validations": [
            _rule(
                "self == oldSelf",
                "model is immutable: the cache layout depends on the model geometry; "
                "create a new pool",
                _IMMUTABLE,
            ),
            _rule(
                "!has(self.numKvHeadsPerLayer) || size(self.numKvHeadsPerLayer) == self.numLayers",
                "numKvHeadsPerLayer must list one entry per layer (numLayers entries)",
                fieldPath=".numKvHeadsPerLayer",
            ),
        ]
    },
    ("model", "name"): {"maxLength": 253},
    ("model", "numLayers"): {"maximum": MAX_LAYERS},
    ("model", "numKvHeadsPerLayer"): {"maxItems": MAX_LAYERS},
    ("model", "numKvHeadsPerLayer", "[*]"): {"minimum": 1},
    ("autoscaling",): {
        "x-kubernetes-validations": [
            _rule(
                "self.minReplicas <= self.maxReplicas",
                "minReplicas must not exceed maxReplicas",
                fieldPath=".minReplicas",
            ),
            _rule(
                "self.scaleDownUsage < self.scaleUpUsage",
                "scaleDownUsage must be below scaleUpUsage, or the autoscaler would flap",
                fieldPath=".scaleDownUsage",
            ),
        ]
    },
    ("rollout", "maxUnavailable"): {
        "x-kubernetes-validations": [
            _rule(
                "type(self) == int ? self >= 1 : self.matches('^[1-9][0-9]?%$|^100%$')",
                "maxUnavailable must be a positive number or a percentage from 1% to 100%",
            )
        ]
    },
    ("monitoring", "interval"): {"pattern": "^[0-9]+(ms|s|m|h)$"},
    # A map-list keyed by name: the API server refuses two tenants of one name
    # ("Duplicate value"), and server-side apply merges tenants by name.
    ("auth", "tenants"): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    },
}
"""Extra schema keys per path under ``spec`` (``[*]`` is an array's items)."""

STATUS_RULES: dict[tuple[str, ...], dict[str, Any]] = {
    ("conditions",): {
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    },
}
"""Extra schema keys per path under ``status``."""
