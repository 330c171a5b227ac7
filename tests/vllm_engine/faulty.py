"""``KvpoolConnector`` with faults a test switches on between phases (tests only).

* ``corrupt``: noise is added to every block the worker loaded, as each layer lands (proves
  the test notices wrong KV: outputs must then differ from the run without a connector);
* ``drop-layer``: the loaded blocks of every layer but the first are zeros in vLLM's pages,
  and nothing is reported (proves a layer past the first matters: outputs must differ);
* ``evict``: between the scheduler's lookup and its lease, the pool is flooded with other
  blocks until what the lookup found is evicted (a real eviction, by the agent's policy);
* ``kill``: after the lease, the agent process is killed, so the worker's read fails;
* ``kill-mid``: the agent process is killed by the worker's load thread once the first layer
  range of every request landed, so the reads of the later layers fail.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import torch

from kvpool_agent.connectors.vllm.connector import KvpoolConnector
from kvpool_agent.dataplane.client import TransferClient
from kvpool_agent.dataplane.keys import KeyNamespace


class FaultyConnector(KvpoolConnector):
    mode = "none"
    args: dict[str, Any] = {}

    @classmethod
    def configure(cls, mode: str, args: dict[str, Any]) -> None:
        cls.mode, cls.args = mode, dict(args)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0 and self.mode == "evict":
            self._flood()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0 and self.mode == "kill":
            self._kill_agent()

    def _scatter_layer(self, layer: int, index: torch.Tensor, kv: torch.Tensor) -> None:
        if self.mode == "corrupt":
            kv = kv + torch.randn(kv.shape, dtype=kv.dtype)
        elif self.mode == "drop-layer" and layer > 0:
            kv = torch.zeros_like(kv)
        super()._scatter_layer(layer, index, kv)

    def _load_chunk_landed(self, chunk: int) -> None:
        if self.mode == "kill-mid" and chunk == 0:
            self._kill_agent()

    def _flood(self) -> None:
        args = self.args
        client = TransferClient(args["replicas"], token=args["token"])
        try:
            geometry = client.geometry()
            ns = KeyNamespace("flood", rank=0)
            blocks = int(args["blocks"])
            for _ in range(0, blocks, 8):
                keys = [f"flood-{time.monotonic_ns()}-{i}".encode() for i in range(8)]
                kv = geometry.empty_kv(8)
                for tensor in kv:
                    tensor.zero_()
                client.put(ns, keys, kv)
        finally:
            client.close()

    def _kill_agent(self) -> None:
        os.kill(int(self.args["pid"]), signal.SIGKILL)
        host, port = self.args["replicas"][0].rsplit(":", 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=0.2).close()
            except OSError:
                return
            time.sleep(0.05)
