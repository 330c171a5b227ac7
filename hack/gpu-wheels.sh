#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with what hack/gpu-check.sh installs on a GPU machine that has
# no network and only its image's packages (Python 3.12, torch with CUDA, numpy, pytest, ...):
#   - cp312 wheels of the runtime dependencies that image lacks, at the versions .venv holds;
#   - the compiled core (agent/native) built abi3 for Python >= 3.11, so it loads on 3.12;
#   - flashinfer-python's unpacked tree as a tar.xz (its wheel alone is 59 MiB; the tarball
#     about 17 MiB) and apache-tvm-ffi's wheel.
# Run it here, where PyPI answers, after hack/lib.sh has set up .venv; then carry .whl with the
# run (the device tool's `carry: [".whl"]`). About 3 minutes, most of it xz.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
. hack/lib.sh
out="${GPU_WHEELS_DIR:-.whl}"
mkdir -p "$out" .git/info
out=$(cd "$out" && pwd)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude

FLASHINFER=0.7.2.post1
TVM_FFI=0.1.15.post2
# What the image lacks of kvpool[agent] and the tests' imports (the rest is there).
MISSING=(pydantic pydantic_core annotated-types typing-inspection fastapi starlette
  annotated-doc opentelemetry-api uvicorn httptools pyzmq pytest-asyncio)

pins=()
for name in "${MISSING[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$version" ] || { echo "gpu-wheels: $name is not in .venv (run hack/lib.sh's setup)" >&2; exit 1; }
  pins+=("$name==$version")
done
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux1 manylinux_2_5; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform any -d "$out" \
  "${pins[@]}" "apache-tvm-ffi==$TVM_FFI"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" "flashinfer-python==$FLASHINFER"
(cd "$work" && python3 -m zipfile -e flashinfer_python-*.whl tree >/dev/null &&
  tar -cf - -C tree flashinfer "flashinfer_python-$FLASHINFER.dist-info" | xz -6 -T0 \
    >"$out/flashinfer-$FLASHINFER.tar.xz")

.venv/bin/python -m pip install -q "maturin>=1.7,<2"
CARGO_TARGET_DIR="${KVPOOL_CACHE_DIR:-$HOME/.cache/kvpool}/native-target-abi3" \
  .venv/bin/maturin build --quiet --release -m agent/native/Cargo.toml \
  --features python,pyo3/abi3-py311 -o "$out"
ls -la "$out"
du -sh "$out"
