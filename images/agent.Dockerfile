# The kvpool node agent image: `kvpool agent` (cache engine, torch kernels, HTTP API).
# Build from the repository root:
#   docker build -f images/agent.Dockerfile -t ghcr.io/kvpool/kvpool:0.1.0 .
# With flashinfer (CUDA nodes):        --build-arg KVPOOL_EXTRAS=agent,gpu
# CPU-only torch (smaller, dev pools):  --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# Runs as uid 65532 (the operator's pod template sets the same uid) with a read-only root
# filesystem; torch/flashinfer caches go to HOME=/tmp, an emptyDir in the agent pods.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent/ agent/
COPY kernels/ kernels/
COPY operator/ operator/
COPY cli/ cli/
RUN pip wheel --no-deps --wheel-dir /wheels .

# The compiled engine core (agent/native, `kvpool-native`): built from source with a pinned
# Rust toolchain; the agent runs the Python engine where it is missing.
FROM ${PYTHON_IMAGE} AS native
ARG RUST_VERSION=1.95.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CARGO_HOME=/opt/cargo RUSTUP_HOME=/opt/rustup PATH=/opt/cargo/bin:$PATH
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates curl gcc libc6-dev; \
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"; \
    rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY agent/native/ agent/native/
RUN pip wheel --no-deps --wheel-dir /wheels ./agent/native

FROM ${PYTHON_IMAGE}
ARG KVPOOL_EXTRAS=agent
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache
COPY --from=build /wheels /wheels
COPY --from=native /wheels /wheels
RUN set -eux; \
    for wheel in /wheels/kvpool-*.whl; do \
      PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL}" pip install "${wheel}[${KVPOOL_EXTRAS}]"; \
    done; \
    pip install /wheels/kvpool_native-*.whl; \
    rm -rf /wheels; \
    kvpool --help >/dev/null; \
    python -c 'import kvpool_native'
USER 65532:65532
WORKDIR /tmp
# HTTP API, /healthz, /readyz and /metrics.
EXPOSE 8000
ENTRYPOINT ["kvpool"]
CMD ["agent", "--config", "/etc/kvpool/agent.yaml"]
