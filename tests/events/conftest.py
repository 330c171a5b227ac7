"""The reference decoders the conformance tests run: vLLM's own classes (``.venv-vllm``) and
llm-d's own adapter (a Go program built from the Go module proxy)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Message:
    """One published (or replayed) message: ``[topic, seq, payload]``."""

    topic: bytes
    seq: int
    payload: bytes


def records(messages: Iterable[Message]) -> bytes:
    """The decoders' stdin: ``[u32 len][topic][u64 seq][u32 len][payload]`` per message."""
    out = bytearray()
    for m in messages:
        out += struct.pack(">I", len(m.topic)) + m.topic + struct.pack(">Q", m.seq)
        out += struct.pack(">I", len(m.payload)) + m.payload
    return bytes(out)


def run_decoder(command: list[str], messages: list[Message]) -> list[dict[str, Any]]:
    """Feed ``messages`` to a decoder and parse its JSON lines."""
    done = subprocess.run(
        command, input=records(messages), capture_output=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{command[0]} failed:\n{done.stderr.decode(errors='replace')}"
    return [json.loads(line) for line in done.stdout.decode().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The ``.venv-vllm`` interpreter, built on demand (hack/vllm-venv.sh is idempotent); a
    venv that cannot be built fails the tests."""
    subprocess.run(["bash", str(REPO / "hack" / "vllm-venv.sh")], check=True, cwd=REPO)
    venv = Path(os.environ.get("KVPOOL_VLLM_VENV", REPO / ".venv-vllm"))
    if not venv.is_absolute():
        venv = REPO / venv
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def llmd_decode() -> Path:
    """llm-d's decoder harness (tests/events/llmd_decode), built once by hack/llmd-decode.sh
    from the Go module proxy into the user's cache; ``KVPOOL_LLMD_DECODE`` names a binary
    built beforehand instead. One that cannot be built fails the tests."""
    given = os.environ.get("KVPOOL_LLMD_DECODE")
    if given:
        return Path(given)
    done = subprocess.run(
        ["bash", str(REPO / "hack" / "llmd-decode.sh")],
        cwd=REPO,
        capture_output=True,
        timeout=1500,
        check=False,
    )
    assert done.returncode == 0, (
        "could not build llm-d's decoder (hack/llmd-decode.sh):\n"
        + done.stderr.decode(errors="replace")[-4000:]
    )
    return Path(done.stdout.decode().strip().splitlines()[-1])


def decode_with_vllm(python: Path, messages: list[Message]) -> tuple[dict[str, Any], list[Any]]:
    """vLLM's schema and its decoding of every message."""
    out = run_decoder([str(python), str(HERE / "vllm_decode.py")], messages)
    return out[0]["schema"], out[1:]


def decode_with_llmd(binary: Path, messages: list[Message]) -> list[dict[str, Any]]:
    return run_decoder([str(binary)], messages)
