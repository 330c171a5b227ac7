# The kvpool operator image: `kvpool operator` (kopf), no torch.
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvpool/kvpool-operator:0.1.0 .
# Runs as uid 65532 with a read-only root filesystem; writes only to /tmp (an emptyDir in
# the chart's Deployment).

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

FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /wheels /wheels
# pip compiles the bytecode at install time, so nothing is written next to the sources later.
RUN set -eux; \
    for wheel in /wheels/kvpool-*.whl; do pip install "${wheel}[operator]"; done; \
    rm -rf /wheels; \
    kvpool --help >/dev/null
USER 65532:65532
WORKDIR /tmp
# kopf's liveness endpoint, when started with --liveness http://0.0.0.0:8080/healthz.
EXPOSE 8080
ENTRYPOINT ["kvpool"]
CMD ["operator", "--all-namespaces", "--standalone", "--liveness", "http://0.0.0.0:8080/healthz"]
