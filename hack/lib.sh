# Shared shell helpers of the hack/ scripts. Source it from the repository root:
#   . hack/lib.sh
# kvpool::setup      idempotent set-up: a virtualenv with the project and its dev extras
#                    (torch CPU included), the compiled engine core (agent/native: Rust, built
#                    from source by maturin; its cargo target dir is cached under
#                    ~/.cache/kvpool), the dev tooling (devtools/: `kvpool-dev`, never
#                    shipped), activated, and the dev cluster binaries (built once from the Go
#                    module proxy, cached under ~/.cache/kvpool)
# kvpool::check_disk stop early, with the reason, when the disk cannot hold the set-up
# kvpool::native     (re)build and install the compiled engine core into the virtualenv
# kvpool::native_into VENV   install that build into another virtualenv (.venv-vllm)
# kvpool::step NAME CMD...   run CMD, print its wall time, remember it for kvpool::timings
# kvpool::timings    print every step's time

# rustup installs cargo under ~/.cargo/bin, which a non-login shell may not have on PATH.
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi

kvpool_step_names=()
kvpool_step_secs=()

kvpool::setup() {
  local venv="${KVPOOL_VENV:-.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  # shellcheck disable=SC1091
  . "$venv/bin/activate"
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e '.[dev]' -e ./devtools
  kvpool::native
  kvpool-dev cluster build
}

kvpool::check_disk() {
  # Each virtualenv is about 6 GiB (PyPI's torch brings its CUDA libraries even on CPU), the
  # caches and test temporaries a few more: a fresh clone needs about 16 GiB. Without it pip
  # fails half-way with ENOSPC, far from the cause; this says it first.
  local need=3 free
  [ -x "${KVPOOL_VENV:-.venv}/bin/python" ] || need=$((need + 7))
  [ -d "${KVPOOL_VLLM_VENV:-.venv-vllm}" ] || need=$((need + 7))
  free=$(df -Pk . | awk 'NR == 2 { print int($4 / 1048576) }')
  if [ "$free" -lt "$need" ]; then
    echo "kvpool: $free GiB free on $(df -P . | awk 'NR == 2 { print $6 }'), the set-up needs about $need GiB" \
      "(two virtualenvs with torch, ~7 GiB each, and the caches): free some space first" \
      "(old clones under /tmp?)" >&2
    return 1
  fi
}

kvpool::native() {
  # pip builds a wheel of agent/native with maturin (from PyPI) and cargo (crates from
  # crates.io); the cached target dir makes a rebuild after a change incremental. The wheel
  # stays in build/native-wheel for kvpool::native_into.
  if ! command -v cargo >/dev/null 2>&1; then
    echo "kvpool: the compiled core (agent/native) needs a Rust toolchain: https://rustup.rs" >&2
    return 1
  fi
  rm -rf build/native-wheel
  CARGO_TARGET_DIR="${KVPOOL_CACHE_DIR:-$HOME/.cache/kvpool}/native-target" \
    python -m pip wheel --quiet --no-deps -w build/native-wheel ./agent/native
  python -m pip install --quiet --no-deps --force-reinstall build/native-wheel/kvpool_native-*.whl
}

kvpool::native_into() {
  # kvpool::native_into VENV: the same wheel into another virtualenv of the same Python (the
  # real-vLLM one, so the connector's same-node copies there are the compiled ones, as in a
  # deployment). A virtualenv of another Python gets a warning and keeps torch's copies.
  "$1/bin/python" -m pip install --quiet --no-deps --force-reinstall \
    build/native-wheel/kvpool_native-*.whl ||
    echo "kvpool: the compiled core does not fit $1's Python: its copies stay torch's" >&2
}

kvpool::step() {
  local name="$1"
  shift
  local start end
  echo "== $name" >&2
  start=$(date +%s.%N)
  # The status is kept and returned: in a `step ... || handler` list, bash ignores errexit
  # inside the function, so a failure must not be lost behind the timing lines.
  local rc=0
  "$@" || rc=$?
  end=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  kvpool_step_names+=("$name")
  kvpool_step_secs+=("$secs")
  if [ "$rc" -ne 0 ]; then
    echo "   ($name: FAILED with exit code $rc after ${secs}s)" >&2
  else
    echo "   ($name: ${secs}s)" >&2
  fi
  return "$rc"
}

kvpool::timings() {
  local i
  echo "== timings" >&2
  for i in "${!kvpool_step_names[@]}"; do
    printf '   %-52s %8ss\n' "${kvpool_step_names[$i]}" "${kvpool_step_secs[$i]}" >&2
  done
}
