"""Shared by the real-vLLM tests: the ``.venv-vllm`` interpreter, the tiny model, and one
engine process run through phases (``run_vllm.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("run_vllm.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The ``.venv-vllm`` interpreter, built on demand (hack/vllm-venv.sh is idempotent); one
    that cannot be built fails the tests."""
    subprocess.run(["bash", str(REPO / "hack" / "vllm-venv.sh")], check=True, cwd=REPO)
    venv = Path(os.environ.get("KVPOOL_VLLM_VENV", REPO / ".venv-vllm"))
    if not venv.is_absolute():
        venv = REPO / venv
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def model_dir(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(vllm_python), str(RUNNER), "make-model", str(out)], check=True)
    return out


def run_engine(
    python: Path, tmp: Path, name: str, spec: dict[str, Any], *, token: str | None = None
) -> dict[str, Any]:
    """One vLLM engine process through ``spec``'s phases; its result document."""
    spec_path, out = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "agent"), str(RUNNER.parent)])
    env.pop("KVPOOL_TOKEN", None)
    if token is not None:
        env["KVPOOL_TOKEN"] = token
    log = tmp / f"{name}.log"
    with open(log, "wb") as sink:
        proc = subprocess.run(
            [str(python), str(RUNNER), "run", str(spec_path), str(out)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=600,
        )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"vLLM engine {name} failed ({proc.returncode}):\n{log.read_text()}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result
