"""The pool's tokens: read from the Secrets that hold them, generated only when missing.

Tokens are generated once and kept: every reconcile reads the existing Secrets first and
writes back the same tokens, so a token changes only when its Secret is gone (deleting a
generated tenant Secret is how a tenant's token is rotated) or was left by an earlier pool of
the same name. A tenant with ``secretName`` uses the token in that Secret of the user's; the
operator never writes it, and reports it when it is missing.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpool_agent.credentials import MAX_TOKEN_LENGTH, new_token
from kvpool_operator import children
from kvpool_operator.children import PoolCredentials
from kvpool_operator.kube import KubeApi
from kvpool_operator.models import KVCachePool

Manifest = dict[str, Any]


@dataclass
class ResolvedCredentials:
    """What one reconcile decided about the pool's tokens."""

    credentials: PoolCredentials
    issued: list[str] = field(default_factory=list)
    """Tenants whose generated token is new in this reconcile (created or rotated)."""
    peer_issued: bool = False
    missing: list[str] = field(default_factory=list)
    """One message per tenant whose own Secret (``secretName``) has no usable token."""
    stale: list[str] = field(default_factory=list)
    """Generated tenant Secrets of tenants that are gone (to delete once the digests are)."""


def secret_value(secret: Manifest | None, key: str) -> str | None:
    """A usable token under ``key`` of a Secret: one line of 1 to 512 non-space characters."""
    raw = ((secret or {}).get("data") or {}).get(key)
    if not isinstance(raw, str):
        return None
    try:
        text = base64.b64decode(raw, validate=True).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not text or len(text) > MAX_TOKEN_LENGTH or any(c.isspace() for c in text):
        return None
    return text


def controlled_by(obj: Manifest | None, pool: KVCachePool) -> bool:
    """Whether the pool is the object's controller (and the object is not being deleted)."""
    meta = (obj or {}).get("metadata") or {}
    if not obj or meta.get("deletionTimestamp"):
        return False
    return any(
        ref.get("controller") and ref.get("uid") == pool.uid
        for ref in meta.get("ownerReferences") or []
    )


def _ours(obj: Manifest | None, pool: KVCachePool) -> Manifest | None:
    """The object if this pool owns it. A Secret of an earlier pool of the same name (the
    garbage collector has not taken it yet) or of someone else holds no token to keep."""
    return obj if controlled_by(obj, pool) else None


def tenant_names(auth_secret: Manifest | None) -> set[str]:
    """The tenants listed in an existing ``<pool>-auth`` Secret."""
    raw = ((auth_secret or {}).get("data") or {}).get(children.TENANTS_KEY)
    try:
        doc = yaml.safe_load(base64.b64decode(raw or "").decode())
    except (binascii.Error, UnicodeDecodeError, yaml.YAMLError):
        return set()
    return {str(k) for k in doc} if isinstance(doc, dict) else set()


def resolve_credentials(
    api: KubeApi, pool: KVCachePool, generate: Callable[[], str] = new_token
) -> ResolvedCredentials:
    """Read the pool's Secrets and decide every token (reads only; the caller applies)."""
    ns = pool.namespace
    auth = _ours(api.get("v1", "Secret", ns, children.auth_secret_name(pool)), pool)
    peer = secret_value(auth, children.PEER_TOKEN_KEY)
    peer_issued = peer is None
    if peer is None:
        peer = generate()
    tokens: dict[str, str] = {}
    generated: set[str] = set()
    issued: list[str] = []
    missing: list[str] = []
    for i, tenant in enumerate(pool.spec.auth.tenants):
        if tenant.secret_name:
            secret = api.get("v1", "Secret", ns, tenant.secret_name)
            token = secret_value(secret, children.TOKEN_KEY)
            if token is None:
                why = "does not exist" if secret is None else "has no usable key `token`"
                missing.append(
                    f"spec.auth.tenants[{i}].secretName: Secret {ns}/{tenant.secret_name} of "
                    f"tenant {tenant.name} {why}; the tenant cannot authenticate until it does"
                )
            else:
                tokens[tenant.name] = token
            continue
        name = children.tenant_secret_name(pool, tenant.name)
        token = secret_value(_ours(api.get("v1", "Secret", ns, name), pool), children.TOKEN_KEY)
        if token is None:
            token = generate()
            issued.append(tenant.name)
        tokens[tenant.name] = token
        generated.add(tenant.name)
    referenced = {t.secret_name for t in pool.spec.auth.tenants if t.secret_name}
    stale = sorted(
        name
        for name in (children.tenant_secret_name(pool, t) for t in tenant_names(auth) - generated)
        if name not in referenced
    )
    return ResolvedCredentials(
        credentials=PoolCredentials(peer, tokens, frozenset(generated)),
        issued=issued,
        peer_issued=peer_issued,
        missing=missing,
        stale=stale,
    )


def delete_stale(api: KubeApi, pool: KVCachePool, names: list[str]) -> list[str]:
    """Delete the generated Secrets of removed tenants (only those the pool controls), so a
    tenant added again later gets a fresh token; returns the names deleted."""
    deleted = []
    for name in names:
        secret = api.get("v1", "Secret", pool.namespace, name)
        if controlled_by(secret, pool) and api.delete("v1", "Secret", pool.namespace, name):
            deleted.append(name)
    return deleted
