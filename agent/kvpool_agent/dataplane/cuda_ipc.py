"""CUDA IPC export of a device arena, for the same-node path on a CUDA agent.

The agent's primary tier on a GPU cannot live in a memfd; an engine on the same node maps it
instead through a CUDA IPC handle (``cudaIpcGetMemHandle`` under torch's storage sharing, the
same handles ``torch.multiprocessing`` passes between processes). The handle travels in the
MAP reply over the Unix socket, after AUTH, so only an authenticated local peer gets it.

``export_arena`` runs in the agent, ``open_arena`` in the engine, which finds the GPU by its
UUID (containers of one pod may number the node's GPUs differently). Both need CUDA; the
message format (``to_meta``/``from_meta``), the UUID match (``local_index``) and the refusal on
a CPU tensor are plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class NotOnCuda(ValueError):
    """The tensor asked for is not in CUDA memory: there is nothing to export."""


@dataclass(frozen=True)
class CudaArenaHandle:
    """What a peer needs to open the arena (torch's ``_share_cuda_`` fields, plus where the
    arena starts in its storage and how long it is)."""

    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    offset: int
    """Byte offset of the arena in the storage."""
    size: int
    """Bytes of the arena."""
    uuid: str = ""
    """The GPU's UUID (``device`` is the agent's index of it, which another container may
    number differently); empty from an agent that did not send it."""

    def to_meta(self) -> dict[str, Any]:
        return {
            "kind": "cuda",
            "device": self.device,
            "handle": self.handle,
            "storage_size": self.storage_size,
            "storage_offset": self.storage_offset,
            "ref_counter_handle": self.ref_counter_handle,
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": self.event_handle,
            "event_sync_required": self.event_sync_required,
            "offset": self.offset,
            "size": self.size,
            "uuid": self.uuid,
        }

    @classmethod
    def from_meta(cls, doc: dict[str, Any]) -> CudaArenaHandle:
        if doc.get("kind") != "cuda":
            raise ValueError(f"map: not a CUDA arena (kind {doc.get('kind')!r})")
        return cls(
            device=int(doc["device"]),
            handle=bytes(doc["handle"]),
            storage_size=int(doc["storage_size"]),
            storage_offset=int(doc["storage_offset"]),
            ref_counter_handle=bytes(doc["ref_counter_handle"]),
            ref_counter_offset=int(doc["ref_counter_offset"]),
            event_handle=bytes(doc["event_handle"]),
            event_sync_required=bool(doc["event_sync_required"]),
            offset=int(doc["offset"]),
            size=int(doc["size"]),
            uuid=str(doc.get("uuid", "")),
        )


def export_arena(arena: torch.Tensor) -> CudaArenaHandle:
    """The IPC handle of a flat uint8 CUDA arena. The arena must outlive every peer that
    opened it (the agent's tiers live as long as the agent)."""
    if arena.device.type != "cuda":
        raise NotOnCuda(
            f"the arena is in {arena.device.type} memory, not CUDA: there is no CUDA IPC "
            "handle to export (a CPU tier is shared through its memfd instead)"
        )
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise ValueError("export_arena: a flat uint8 tensor is expected")
    storage = arena.untyped_storage()
    (
        device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return CudaArenaHandle(
        device=int(device),
        handle=bytes(handle),
        storage_size=int(storage_size),
        storage_offset=int(storage_offset),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
        offset=int(arena.storage_offset()),
        size=arena.numel(),
        uuid=str(torch.cuda.get_device_properties(int(device)).uuid),
    )


def local_index(handle: CudaArenaHandle, visible: Sequence[str]) -> int:
    """This process's index of the agent's GPU, found by UUID among ``visible`` (the UUIDs
    of this process's devices, in index order); the agent's own index when it sent no
    UUID. A GPU this process cannot see is refused: the engine's pages would not be there."""
    if not handle.uuid:
        return handle.device
    if handle.uuid in visible:
        return list(visible).index(handle.uuid)
    raise NotOnCuda(
        f"the agent's arena is on GPU {handle.uuid}, which this process does not see "
        f"(it sees {len(visible)}: {', '.join(visible) or 'none'}); give the engine that GPU"
    )


def open_arena(handle: CudaArenaHandle) -> torch.Tensor:
    """The peer's view of an exported arena: a flat uint8 tensor on the same device (in the
    engine's process; CUDA IPC does not open a handle in the process that made it)."""
    if not torch.cuda.is_available():
        raise NotOnCuda("open_arena: this process has no CUDA device")
    torch.cuda._lazy_init()
    count = torch.cuda.device_count()
    visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    device = local_index(handle, visible)
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        handle.handle,
        handle.storage_size,
        handle.storage_offset,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    out = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    out.set_(storage, handle.offset, (handle.size,), (1,))
    return out
