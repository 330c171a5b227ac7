#!/usr/bin/env bash
# kvpool's GPU checks, in one run on a CUDA machine that has no network (the device machine
# of the development workplace: Python 3.12, torch with CUDA, nvcc and ninja in its image).
#
# What the machine lacks travels in .whl/ (ignored by git), which hack/gpu-wheels.sh fills on a
# machine with PyPI: cp312 wheels of the runtime dependencies the image lacks, the compiled
# core built abi3, flashinfer's unpacked tree as a tar.xz and apache-tvm-ffi. Optionally
# .whl/fi-jit.tar.xz: the flashinfer modules an earlier run compiled (its $OUT/fi-jit.tar.xz),
# laid out as flashinfer's AOT directory, so they are not compiled again (about 3 minutes of
# compiling on 16 cores for the FA2 variants the tests use).
# Steps run in order of what matters most, each under its own time limit, and a failed step
# does not stop the next; results go to $OUT/res, logs to $OUT/logs.tar.gz and the compiled
# flashinfer modules to $OUT/fi-jit.tar.xz ($OUT defaults to /tmp/kvpool-gpu).
#
#   hack/gpu-check.sh            # tests, bench-connector, kernels, bench-kernels
#   GPU_CHECK_STEPS="tests bench-connector" hack/gpu-check.sh
#   GPU_CHECK_STEPS="kernels-fa3" hack/gpu-check.sh   # flashinfer's own choice (FA3 on
#       # Hopper) against the reference: passed on an H200, after about 9.5 minutes of
#       # compiling with MAX_JOBS=16 from cold, over two calls on the same warm machine (its
#       # compiled modules stay there between calls; the first call's step ran out of time)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvpool-gpu}"
mkdir -p "$OUT/logs" "$OUT/res"
STEPS="${GPU_CHECK_STEPS:-tests bench-connector kernels bench-kernels}"
site=/tmp/kvpool-site
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# flashinfer compiles each kernel variant on first use (FA2, the default implementation,
# several times faster than FA3: KVPOOL_FLASHINFER_BACKEND=auto checks FA3 on Hopper and
# needs minutes more), and the kernel tests' four workers compile variants side by side.
export MAX_JOBS="${MAX_JOBS:-6}"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/logs/NAME.log
  local name="$1" limit="$2" start rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${limit}s)"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "   $name: exit $rc after $(($(date +%s) - start))s"
  tail -n 25 "$OUT/logs/$name.log"
  return 0
}

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" .whl/*.whl || exit 1
tar -xJf .whl/flashinfer-*.tar.xz -C "$site" || exit 1
if [ -f .whl/fi-jit.tar.xz ]; then
  mkdir -p "$site/flashinfer/data/aot" && tar -xJf .whl/fi-jit.tar.xz -C "$site/flashinfer/data/aot"
fi
export PYTHONPATH="$site:$PWD/agent:$PWD/kernels:$PWD/operator:$PWD/cli"
python3 - <<'EOF'
import torch, flashinfer, kvpool_native
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), flashinfer {flashinfer.__version__},"
      f" {torch.cuda.get_device_name()}, compiled core {kvpool_native.__name__}")
EOF

# 1. The data plane, the connector's copies and save queue, and sizing on CUDA (no flashinfer).
step tests 200 python3 -m pytest -m gpu -p no:cacheprovider -q \
  tests/dataplane/test_cuda_paths.py tests/dataplane/test_shm.py \
  tests/connectors/test_layerwise_cuda.py tests/connectors/test_saves.py \
  tests/agent/test_sizing_cuda.py \
  tests/kernels/test_flashinfer_gpu.py -k "not flashinfer_matches and not append_matches"
# 2. The connector's GPU copies against the copy rates of the same machine.
step bench-connector 120 python3 bench/connector_gpu.py --out "$OUT/res"
# 3. flashinfer against the torch reference.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
# shellcheck disable=SC2086
step kernels 150 python3 -m pytest -m gpu -p no:cacheprovider -q $workers tests/kernels tests/model
# 3b. The same with flashinfer's own choice (FA3 on Hopper); opt-in, see the header.
# shellcheck disable=SC2086
step kernels-fa3 480 env KVPOOL_FLASHINFER_BACKEND=auto MAX_JOBS=16 \
  python3 -m pytest -m gpu -p no:cacheprovider -q $workers tests/kernels tests/model
# 4. Decode bandwidth and block copies.
step bench-kernels 110 python3 bench/kernels.py --out "$OUT/res" --iters 10 \
  --batches 1 16 64 256 --contexts 1024 4096 16384

# What was compiled, for the next run (.whl/fi-jit.tar.xz).
jit=$(python3 -c "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)" 2>/dev/null)
if [ -n "$jit" ] && [ -d "$jit" ]; then
  (cd "$jit" && find . -mindepth 2 -maxdepth 2 -name '*.so' -print0 |
    tar --null -cf - -T - | xz -1 -T0 >"$OUT/fi-jit.tar.xz")
  ls -la "$OUT/fi-jit.tar.xz"
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
