#!/usr/bin/env bash
# Builds (once) `.venv-bench`: the bench-only virtualenv where the real vLLM and SGLang cache
# managers run beside kvpool's engine (bench/cache_ops.py, bench/policy_memory.py).
# Neither is ever a dependency of kvpool.
#
#   1. vLLM on CPU exactly as the `vllm` tests get it (hack/vllm-venv.sh, into this venv);
#   2. SGLang's wheel with --no-deps: only its radix tree is used, and the modules that tree
#      imports need a few pure-Python packages beyond vLLM's (orjson, IPython, gguf);
#   3. matplotlib for the plots;
#   4. kvpool's compiled core (agent/native), rebuilt on every run (incremental: cached target).
# A stamp file records the versions; a second run with the same ones only does step 4.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION="${KVPOOL_SGLANG_VERSION:-0.5.23}"
venv="${KVPOOL_BENCH_VENV:-.venv-bench}"
stamp="$venv/.kvpool-bench-sglang-$SGLANG_VERSION"
native() {
  CARGO_TARGET_DIR="${KVPOOL_CACHE_DIR:-$HOME/.cache/kvpool}/native-target" \
    "$venv/bin/python" -m pip install --quiet ./agent/native
}
if [ -f "$stamp" ]; then
  native
  exit 0
fi
KVPOOL_VLLM_VENV="$venv" hack/vllm-venv.sh
py="$venv/bin/python"
torch_pin="torch==$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
echo "== bench venv: sglang==$SGLANG_VERSION (no deps) and what its radix tree imports" >&2
"$py" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
"$py" -m pip install --quiet orjson ipython gguf matplotlib -c <(echo "$torch_pin")
"$py" -c "import sglang.srt.mem_cache.radix_cache, vllm.v1.core.kv_cache_manager; print('sglang $SGLANG_VERSION and vllm import')"
touch "$stamp"
native
