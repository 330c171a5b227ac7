// llm-d's KV-event decoder, run by tests/events over what a real agent published.
// Built by hack/llmd-decode.sh into ~/.cache/kvpool/llmd-decode/<version>/ (never in the
// repository), resolving the pinned version below through the Go module proxy.
module kvpool.local/llmd-decode

go 1.25.0

require github.com/llm-d/llm-d-kv-cache v0.9.0
