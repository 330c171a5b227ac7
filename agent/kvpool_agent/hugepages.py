"""Transparent huge pages behind the host arenas: the advice, and what a mapping got.

The agent's CPU arena (``cache/storage.py``) and an engine's mapping of it (``ShmClient``)
are advised before their first touch; ``huge_page_bytes`` reads back how much of a mapping
the kernel backs with 2 MiB pages (the agent exports it as a metric), since the advice is
only a request.
"""

from __future__ import annotations

import contextlib
import mmap

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14's advice that faults a range in writable (Python 3.11 lacks the constant)."""


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages (2 MiB) behind a host arena, before its first touch.

    A request's blocks are scattered over the arena, so a copy into or out of them moves to
    another page every piece or two: with 4 KiB pages that is a TLB miss each time
    (``bench/arena_pages.py``). Private memory gets them where
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``; a shared
    arena (a memfd) only where ``.../shmem_enabled`` is ``advise``, ``within_size`` or
    ``always`` (docs/dataplane.md, "Huge pages"). Elsewhere the advice changes nothing, as
    on a platform without ``MADV_HUGEPAGE``."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without THP refuses it: 4 KiB pages
            mapping.madvise(advice)


HUGE_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")
"""The lines of ``/proc/self/smaps`` that count a mapping's bytes mapped by 2 MiB pages
(private, shared memory, and files)."""


def huge_page_bytes(address: int, length: int, smaps: str = "/proc/self/smaps") -> int:
    """Bytes of ``[address, address + length)``'s mappings that 2 MiB pages back, by the
    kernel's own count (0 where ``smaps`` cannot be read: not Linux, or no procfs)."""
    try:
        with open(smaps) as f:
            lines = f.readlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
            lo, _, hi = head.partition("-")
            try:
                start, end = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            inside = start < address + length and address < end
        elif inside and head in HUGE_FIELDS:
            total += int(line.split()[1]) * 1024
    return total


SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_setting(path: str = SHMEM_ENABLED) -> str | None:
    """The node's policy for huge pages in shared memory (the bracketed word of ``path``:
    ``never``, ``advise``, ...), or None where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
