"""Fixtures for the data plane tests: an agent (service + transfer port on 127.0.0.1:0) running
in-process on its own event loop thread, so blocking clients and raw sockets can talk to it."""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml
from agent.conftest import snapshot_state  # tests/agent (a package beside this one)

from kvpool_agent.config import AgentConfig
from kvpool_agent.credentials import token_digest
from kvpool_agent.dataplane import server as server_module
from kvpool_agent.dataplane import shm as shm_module
from kvpool_agent.dataplane.client import TORCH_DTYPES, TransferClient
from kvpool_agent.dataplane.keys import KeyNamespace
from kvpool_agent.dataplane.protocol import (
    F_ERROR,
    HEADER_SIZE,
    Header,
    Op,
    frame,
    unpack_header,
    unpack_meta,
)
from kvpool_agent.dataplane.server import TransferServer
from kvpool_agent.server.service import AgentService

T = TypeVar("T")
TPB = 4
BLOCKS = 64
TOKENS = {"a": "token-of-tenant-a-0123456789", "b": "token-of-tenant-b-0123456789"}
PEER = "the-pools-own-peer-token-0123456789"
NS = KeyNamespace("test-model", rank=0, layer_group=0)


def agent_config(**overrides: Any) -> AgentConfig:
    """2 layers, 2 kv heads, head_dim 8, float32, 4 tokens per block, 64 primary blocks."""
    doc: dict[str, Any] = {
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "kv_cache_config": {"tokens_per_block": TPB, "enable_partial_reuse": False},
        "device": "cpu",
        "cpu_budget_bytes": BLOCKS * 2 * 2 * 2 * 8 * TPB * 4,
        "events": {"endpoint": None, "replay_endpoint": None},
        "transfer": {"port": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return AgentConfig.model_validate(doc)


def write_auth(tmp: Path) -> dict[str, str]:
    """A tenants file (a, b) and a peer token; returns the ``auth`` config section."""
    (tmp / "tenants.yaml").write_text(
        yaml.safe_dump({name: token_digest(tok) for name, tok in TOKENS.items()})
    )
    (tmp / "peer-token").write_text(PEER + "\n")
    return {"tenants_file": str(tmp / "tenants.yaml"), "peer_token_file": str(tmp / "peer-token")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cuda_socket_agent(
    start_agent: Callable[..., Any], tmp: Path, doc: dict[str, Any], name: str
) -> tuple[Any, str]:
    """A real ``kvpool agent`` process with ``doc`` (its model, device and cache sections),
    tenants a and b, and a Unix socket ``name`` in a short directory (a socket's path has
    107 bytes); the agent and the socket's path."""
    sock_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvp-{os.getpid()}"
    sock_dir.mkdir(exist_ok=True)
    path = str(sock_dir / name)
    port = free_port()
    full = {
        "events": {"endpoint": None, "replay_endpoint": None},
        "auth": write_auth(tmp),
        **doc,
        "transfer": {**doc.get("transfer", {}), "unix_socket": path},
    }
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump(full))
    return start_agent(config, port, "--port", str(port)), path


class Agent:
    """An AgentService and its TransferServer on a private event loop thread."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service: AgentService = self.run(self._start())
        self.address = f"127.0.0.1:{self.server.port}"

    async def _start(self) -> AgentService:
        service = AgentService(self.config)
        await service.start()
        self.server = TransferServer(service, host="127.0.0.1", port=0)
        await self.server.start()
        return service

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn`` on the agent's loop, under the engine lock (a consistent view)."""
        out: T = self.run(self.service.call(fn))
        return out

    def state(self, arena: bool = True) -> tuple[Any, ...]:
        """Everything a rejected request must leave unchanged (tests/agent's snapshot_state).
        ``arena=False`` leaves out the pool bytes: a store aborted after its bytes arrived
        (a bad checksum) leaves them in blocks that are free again, which nobody can read
        (a block is zeroed or fully written before anyone sees it)."""

        def grab() -> tuple[Any, ...]:
            return snapshot_state(self.service, arena=arena)

        return self.call(grab)

    def usage(self) -> list[dict[str, Any]]:
        return self.call(self.service.engine.usage)

    def client(self, token: str | None = None, **kw: Any) -> TransferClient:
        return TransferClient([self.address], token=token, **kw)

    def close(self) -> None:
        async def stop() -> None:
            await self.server.stop()
            await self.service.stop()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture(params=["compiled", "python"])
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both byte movers: the compiled ones (``kvpool_native.Receiver`` for a
    PUT's receive, ``Sender`` for a GET's send, ``copy_spans`` for the same-node copies,
    ``shm_put`` for a same-node PUT's whole exchange) and the Python fallbacks that serve
    when the compiled core is not installed."""
    if request.param == "compiled":
        if server_module.Receiver is None or shm_module._copy_spans is None:
            pytest.skip("the compiled core (kvpool_native) is not installed")
    else:
        monkeypatch.setattr(server_module, "Receiver", None)
        monkeypatch.setattr(server_module, "Sender", None)
        monkeypatch.setattr(shm_module, "_copy_spans", None)
        monkeypatch.setattr(shm_module, "_shm_put", None)
    return str(request.param)


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent(agent_config())
    yield a
    a.close()


@pytest.fixture
def auth_agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(agent_config(auth=write_auth(tmp_path), limits={"tenant_max_open_sequences": 4}))
    yield a
    a.close()


def keys_for(tag: int, n: int) -> list[bytes]:
    """A chain of ``n`` distinct 32-byte keys (chained like vLLM's: each commits to its parent)."""
    import hashlib

    out, parent = [], tag.to_bytes(8, "little")
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def round_trip_six_blocks(client: TransferClient) -> None:
    """PUT a chain of six random blocks, look it up, lease it, GET it whole and a sub-range
    of blocks and layers, compare, release (the data plane's basic round trip)."""
    keys = keys_for(1, 6)
    kv = random_kv(client, 6, seed=1)
    assert client.lookup(NS, keys) == []
    result = client.put(NS, keys, kv)
    assert (result.stored, result.resident) == (6, 0)
    assert client.lookup(NS, keys) == ["primary"] * 6
    lease = client.lease(NS, keys, ttl_s=30)
    assert lease is not None and lease.count == 6 and lease.first_block == [0]
    out = client.empty_kv(6)
    client.get_into(lease, out)
    assert torch.equal(out[0], kv[0])
    # A sub-range of blocks and of layers.
    part = client.empty_kv(3, layers=(1, 2))
    client.get_into(lease, part, start=2, count=3, layers=(1, 2))
    assert torch.equal(part[0], kv[0][1:2, 2:5])
    client.release(lease)
    client.release(lease)  # gone already: counts as released


def random_kv(client: TransferClient, blocks: int, seed: int) -> list[torch.Tensor]:
    geo = client.geometry()
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(geo.kv_shape(p.index, blocks), generator=g).to(TORCH_DTYPES[p.dtype])
        for p in geo.pools
    ]


# ---------------------------------------------------------------------- raw sockets


class Raw:
    """A raw protocol connection (blocking socket) for frames the client would never send."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, op: int, meta: dict[str, Any] | None = None, rid: int = 1, **kw: Any) -> None:
        self.send(frame(op, rid, meta, **kw))

    def auth(self, token: str | None = None) -> dict[str, Any]:
        self.request(Op.AUTH, {"token": token} if token else None)
        head, meta = self.reply()
        assert not head.flags & F_ERROR, meta
        return meta

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return bytes(out)

    def reply(self) -> tuple[Header, dict[str, Any]]:
        head = unpack_header(self.recv_exact(HEADER_SIZE))
        meta = unpack_meta(self.recv_exact(head.meta_len))
        if head.data_len:
            self.data = self.recv_exact(head.data_len)
        return head, meta

    def closed(self, timeout: float = 5.0) -> bool:
        """Whether the agent closed the connection (EOF or reset within ``timeout``)."""
        deadline = time.monotonic() + timeout
        try:
            while True:  # skip what is still in flight (an error reply)
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                if self.sock.recv(65536) == b"":
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def header_bytes(
    op: int, rid: int, meta_len: int, data_len: int, *, magic: bytes = b"KVPX", version: int = 1
) -> bytes:
    return struct.pack("<4sBBHQIIQ", magic, version, op, 0, rid, meta_len, 0, data_len)


SMAPS = Path("/proc/self/smaps")
advice_works = pytest.mark.skipif(
    not SMAPS.exists()
    or not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="needs Linux with transparent huge pages (procfs, MADV_HUGEPAGE)",
)


def vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping holding ``address`` in this process."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            inside = int(lo, 16) <= address < int(hi, 16)
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")
