"""Bearer-token credentials of an agent: who is calling, as which tenant.

A pool has tenants and one peer credential. Each tenant holds a random token (the operator
keeps it in a Secret the tenant's pods mount); the agent holds only the SHA-256 digests, in a
YAML file ``{tenant: "sha256:<hex>"}``, so reading the agent's files gives no usable token.
The peer token is what the agents of one pool present to each other (warm handoff) and what
reads the event replay; the agent needs it in clear to send it.

This module stays light (no torch, no web framework): the operator uses ``token_digest`` and
``new_token`` to write the Secrets the agents read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvpool_agent.config import TENANT_NAME_PATTERN, AuthConfig, ConfigError

log = logging.getLogger("kvpool.agent.auth")

DIGEST_PREFIX = "sha256:"
TOKEN_BYTES = 32
MAX_TOKEN_LENGTH = 512
_TENANT = re.compile(TENANT_NAME_PATTERN)


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_digest(token: str) -> str:
    """What the agent stores for a token: ``sha256:<hex>``."""
    return DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """The caller of one request, as the agent decided it."""

    tenant: str | None
    """The tenant whose namespace and sequences the request uses; None: auth is off."""
    peer: bool
    """Holds the pool's own credential (handoff, event replay); always true with auth off."""


ANONYMOUS = Principal(tenant=None, peer=True)
"""Every caller of an agent that runs without credentials (loopback, or explicitly allowed)."""


class AuthError(Exception):
    """A request without a valid credential (401) or without the right one (403)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


Fingerprint = tuple[int, int, int, int] | None


def _fingerprint(path: Path) -> Fingerprint:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def parse_tenants(text: str, source: str) -> dict[str, str]:
    """``{digest: tenant}`` from a tenants file; raises ConfigError naming what is wrong."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: must map tenant names to token digests")
    out: dict[str, str] = {}
    for name, digest in doc.items():
        if not isinstance(name, str) or not _TENANT.match(name):
            raise ConfigError(
                f"{source}: tenant {name!r}: must be a DNS label ({TENANT_NAME_PATTERN})"
            )
        if (
            not isinstance(digest, str)
            or not digest.startswith(DIGEST_PREFIX)
            or len(digest) != len(DIGEST_PREFIX) + 64
        ):
            raise ConfigError(f"{source}: tenant {name}: digest must be sha256:<64 hex digits>")
        out[digest.lower()] = name
    return out


class Credentials:
    """The tenants and peer token of one agent; ``refresh()`` re-reads changed files, so a
    rotated Secret takes effect without a restart. A file that turns invalid is logged and
    the last good credentials stay."""

    def __init__(self, config: AuthConfig) -> None:
        self.enabled = config.tenants_file is not None
        self._tenants_path = Path(config.tenants_file) if config.tenants_file else None
        self._peer_path = Path(config.peer_token_file) if config.peer_token_file else None
        self._seen: tuple[Fingerprint, Fingerprint] = (None, None)
        self.tenants: dict[str, str] = {}
        self._peer_token: str | None = None
        self._peer_digest: bytes | None = None
        self.reload_errors = 0
        self.refresh(strict=True)

    @property
    def tenant_names(self) -> list[str]:
        return sorted(set(self.tenants.values()))

    @property
    def peer_token(self) -> str | None:
        """The token to present to peer agents of the pool (None: none configured)."""
        return self._peer_token

    def refresh(self, *, strict: bool = False) -> bool:
        """Re-read the files if they changed; returns whether anything was reloaded.

        ``strict`` (at start-up) raises ConfigError on a missing or invalid file; later a bad
        file is counted in ``reload_errors`` and the running credentials stay.
        """
        now = (
            _fingerprint(self._tenants_path) if self._tenants_path else None,
            _fingerprint(self._peer_path) if self._peer_path else None,
        )
        if now == self._seen and not strict:
            return False
        try:
            tenants = self._read_tenants()
            peer = self._read_peer()
        except ConfigError as err:
            if strict:
                raise
            self.reload_errors += 1
            log.error("credentials not reloaded, keeping the running ones: %s", err)
            self._seen = now
            return False
        self._seen = now
        self.tenants = tenants
        self._peer_token = peer
        self._peer_digest = hashlib.sha256(peer.encode()).digest() if peer else None
        return True

    def _read_tenants(self) -> dict[str, str]:
        if self._tenants_path is None:
            return {}
        try:
            text = self._tenants_path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"auth.tenants_file {self._tenants_path}: {err}") from None
        return parse_tenants(text, f"auth.tenants_file {self._tenants_path}")

    def _read_peer(self) -> str | None:
        if self._peer_path is None:
            return None
        try:
            token = self._peer_path.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"auth.peer_token_file {self._peer_path}: {err}") from None
        if not token or len(token) > MAX_TOKEN_LENGTH:
            raise ConfigError(
                f"auth.peer_token_file {self._peer_path}: must hold one token of 1 to "
                f"{MAX_TOKEN_LENGTH} characters"
            )
        return token

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header; raises AuthError(401) without one."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise AuthError(401, "authorization: a bearer token is required")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_LENGTH:
            raise AuthError(401, "authorization: expected 'Bearer <token>'")
        raw = hashlib.sha256(token.encode()).digest()
        if self._peer_digest is not None and hmac.compare_digest(raw, self._peer_digest):
            return Principal(tenant=None, peer=True)
        tenant = self.tenants.get(DIGEST_PREFIX + raw.hex())
        if tenant is None:
            raise AuthError(401, "authorization: unknown or revoked token")
        return Principal(tenant=tenant, peer=False)
