#!/usr/bin/env bash
# Refresh the chart's copy of the KVCachePool CRD from the generator (`kvpool crd`).
#   hack/sync-chart-crd.sh          write charts/kvpool/crds/kvcachepools.yaml
#   hack/sync-chart-crd.sh --check  exit 1 when it, or crds/kvcachepools.yaml, is stale
# crds/kvcachepools.yaml itself is written by `kvpool crd --output crds/kvcachepools.yaml`.
# $PYTHON names the interpreter that has the project (default: python3 on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
chart_crd=charts/kvpool/crds/kvcachepools.yaml
py="${PYTHON:-python3}"
case "${1:-}" in
  --check)
    status=0
    "$py" -m kvpool_cli crd --output crds/kvcachepools.yaml --check || status=1
    "$py" -m kvpool_cli crd --output "$chart_crd" --check || status=1
    exit "$status"
    ;;
  "")
    "$py" -m kvpool_cli crd --output "$chart_crd"
    echo "wrote $chart_crd"
    ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac
