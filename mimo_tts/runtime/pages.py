"""The pages of weights that lie in a mapped checkpoint file (a zero-copy safetensors load):
where they are, and advice to the kernel about them (madvise).

- `drop`: after a kernel packed a mapped weight into memory of its own, give back the file's
  resident pages (clean copies of the file; a later read would fault them in again).
- `prefetch`: ask for a mapped weight's pages ahead of use (MADV_WILLNEED: the kernel reads
  them in the background), e.g. Stage-1's decoder while Stage-0 generates a stream's first
  groups, so its first decode does not wait for the disk.
Memory that is not a file mapping (PyTorch's own allocations) is never advised.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch

_libc: ctypes.CDLL | None = None


def file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files, from /proc/self/maps."""
    spans = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    spans.append((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return spans


def file_pages(t: torch.Tensor, spans: list[tuple[int, int]] | None = None
               ) -> tuple[int, int] | None:
    """(start, length) of the whole pages of `t` inside one file mapping, or None (anonymous
    memory, or less than a page). `spans`: `file_mappings()`, read once for many tensors."""
    if t.device.type != "cpu" or not t.numel():
        return None
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for a, b in file_mappings() if spans is None else spans:
        if a <= start < b:
            first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            last = min(end, b) // mmap.PAGESIZE * mmap.PAGESIZE
            return (first, last - first) if last > first else None
    return None


def advise(pages: Iterable[tuple[int, int]], advice: int) -> int:
    """madvise each (start, length) of `pages`; the bytes the kernel took the advice for."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for start, length in pages:
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0:
            done += length
    return done


def drop(t: torch.Tensor) -> int:
    """Give back the resident file pages of a mapped `t` (MADV_DONTNEED); the bytes dropped."""
    pages = file_pages(t)
    return advise([pages], mmap.MADV_DONTNEED) if pages else 0


def mapped_pages(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The file pages of each mapped tensor of `tensors` (anonymous ones left out)."""
    spans = file_mappings()
    return [p for t in tensors if (p := file_pages(t, spans)) is not None]


def prefetch(pages: Iterable[tuple[int, int]]) -> int:
    """Ask the kernel to read these file pages in the background (MADV_WILLNEED); the bytes
    it took the advice for. Pages already resident cost it a look each."""
    return advise(pages, mmap.MADV_WILLNEED)
