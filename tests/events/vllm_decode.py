"""Decodes captured KV-event messages with vLLM's own classes; run by ``.venv-vllm``'s python.

Stdin: the records ``llmd_decode/main.go`` reads: ``[u32 topic length][topic][u64 seq]
[u32 payload length][payload]``, big-endian. Stdout, JSON lines: first ``{"schema": ...}``,
the installed vLLM's event classes (fields in order, how many have no default, their msgspec
options), then one object per record: ``seq``, ``topic``, ``ts``, ``data_parallel_rank``,
``events`` (``msgspec.to_builtins`` of the decoded structs), ``reencoded`` (whether
``msgspec.msgpack.Encoder().encode`` of the decoded batch gives back the very same bytes) and
``error`` (why ``msgspec.msgpack.Decoder(type=KVEventBatch)`` refused the payload).
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Any, BinaryIO

import msgspec
from vllm.distributed import kv_events


def schema() -> dict[str, Any]:
    out: dict[str, Any] = {}
    classes = (
        kv_events.KVEventBatch,
        kv_events.BlockStored,
        kv_events.BlockRemoved,
        kv_events.AllBlocksCleared,
    )
    for cls in classes:
        fields = list(cls.__struct_fields__)
        config = cls.__struct_config__
        out[cls.__name__] = {
            "fields": fields,
            "required": len(fields) - len(cls.__struct_defaults__),
            "array_like": config.array_like,
            "omit_defaults": config.omit_defaults,
            "tag": config.tag,
            "tag_field": config.tag_field,
        }
    return out


def records(stream: BinaryIO) -> Any:
    while header := stream.read(4):
        (n,) = struct.unpack(">I", header)
        topic = stream.read(n)
        (seq,) = struct.unpack(">Q", stream.read(8))
        (n,) = struct.unpack(">I", stream.read(4))
        yield topic, seq, stream.read(n)


def main() -> None:
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    print(json.dumps({"schema": schema()}))
    for topic, seq, payload in records(sys.stdin.buffer):
        rec: dict[str, Any] = {"seq": seq, "topic": topic.decode()}
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError as err:
            rec["error"] = str(err)
        else:
            rec["ts"] = batch.ts
            rec["data_parallel_rank"] = batch.data_parallel_rank
            rec["events"] = [msgspec.to_builtins(e) for e in batch.events]
            rec["reencoded"] = encoder.encode(batch) == payload
        print(json.dumps(rec))


if __name__ == "__main__":
    main()
