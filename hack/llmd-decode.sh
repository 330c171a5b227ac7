#!/usr/bin/env bash
# Builds (once) llm-d's KV-event decoder harness, tests/events/llmd_decode, and prints the
# path of the binary. It lives outside the repository, in
# ${KVPOOL_CACHE_DIR:-~/.cache/kvpool}/llmd-decode/<llm-d-kv-cache version>/, named after a
# digest of the harness's go.mod and main.go (an edit rebuilds it).
#
# The llm-d module comes, at the version go.mod pins, from the Go module proxy ($GOPROXY, the
# default one unless set), as do its dependencies; the checksums from the proxy's checksum
# database. pkg/kvevents builds without cgo.
set -euo pipefail
cd "$(dirname "$0")/.."
src=tests/events/llmd_decode
version="$(awk '$1 == "require" && $2 == "github.com/llm-d/llm-d-kv-cache" { print $3 }' "$src/go.mod")"
if [ -z "$version" ]; then
  echo "llmd-decode: no github.com/llm-d/llm-d-kv-cache version in $src/go.mod" >&2
  exit 1
fi
digest="$(cat "$src/go.mod" "$src/main.go" | sha256sum | cut -c1-16)"
dir="${KVPOOL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool}/llmd-decode/$version"
bin="$dir/llmd-decode-$digest"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$dir"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$src/go.mod" "$src/main.go" "$work/"
echo "== llmd-decode: building against github.com/llm-d/llm-d-kv-cache $version" >&2
(cd "$work" && CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -o "$work/llmd-decode" . >&2)
mv "$work/llmd-decode" "$bin"
echo "$bin"
