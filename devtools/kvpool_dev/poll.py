"""Polling and loopback HTTP for the dev tooling and the tests that use it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback only: an HTTP(S)_PROXY in the environment must never catch these calls."""


def wait_until(
    what: str, probe: Callable[[], Any], timeout: float = 90.0, every: float = 0.5
) -> Any:
    """Poll ``probe`` every ``every`` seconds until it returns something truthy, and return
    that; after ``timeout`` seconds, AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def http_get(
    url: str, timeout: float = 2.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    try:
        with DIRECT.open(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


def agent_ready(url: str) -> bool:
    try:
        return http_get(f"{url}/readyz", timeout=2.0)[0] == 200
    except OSError:
        return False
