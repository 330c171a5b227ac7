"""Huge pages behind the host arenas: the agent's arena is advised for 2 MiB pages before its
first touch, and what the kernel gave is read back (an engine's mapping: ``test_shm.py``)."""

from __future__ import annotations

from pathlib import Path

from kvpool_agent.hugepages import huge_page_bytes, shmem_setting
from kvpool_agent.server.service import AgentService

from .conftest import advice_works, agent_config, vm_flags

FAKE_SMAPS = """\
00400000-00600000 r-xp 00000000 08:01 1 /usr/bin/python
Size:               2048 kB
AnonHugePages:      2048 kB
7f0000000000-7f0000400000 rw-s 00000000 00:01 2 /memfd:kvpool-arena (deleted)
Size:               4096 kB
AnonHugePages:         0 kB
ShmemPmdMapped:     2048 kB
FilePmdMapped:         0 kB
VmFlags: rd wr sh mr mw me ms hg
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
VmFlags: rd wr mr mw me ac hg
"""


def test_huge_page_bytes_counts_only_the_mappings_a_range_overlaps(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(FAKE_SMAPS)
    arena = 0x7F0000000000
    assert huge_page_bytes(arena, 4 << 20, str(smaps)) == 2 << 20  # its shmem pages only
    assert huge_page_bytes(arena + (1 << 20), 4 << 20, str(smaps)) == 6 << 20  # and the next
    assert huge_page_bytes(0x10, 16, str(smaps)) == 0  # nothing mapped there
    assert huge_page_bytes(arena, 1, str(tmp_path / "missing")) == 0


def test_shmem_setting_is_the_bracketed_word(tmp_path: Path) -> None:
    path = tmp_path / "shmem_enabled"
    path.write_text("always within_size [advise] never deny force\n")
    assert shmem_setting(str(path)) == "advise"
    path.write_text("nothing chosen\n")
    assert shmem_setting(str(path)) is None
    assert shmem_setting(str(tmp_path / "missing")) is None


@advice_works
def test_a_private_cpu_arena_is_advised_for_huge_pages() -> None:
    service = AgentService(agent_config())
    primary = service.engine.storage[0]
    assert primary.shared_fd is None
    assert "hg" in vm_flags(primary.arena.data_ptr())
    # What the kernel gave is read back, never more than the arena.
    assert 0 <= primary.huge_page_bytes <= primary.nbytes
