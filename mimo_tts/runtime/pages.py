"""The pages of weights that lie in a mapped checkpoint file (a zero-copy safetensors load),
and `drop`: after a kernel (the LM's, the codec GEMM) packed a mapped weight into memory of
its own, give back the file's resident pages (clean copies of the file; a later read would
fault them in again). Memory that is not a file mapping (PyTorch's own allocations) is never
advised. `trim`: give the C heap's free memory back (the temporaries of packing).
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch


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


def file_pages(t: torch.Tensor) -> tuple[int, int] | None:
    """(start, length) of the whole pages of `t` inside one file mapping, or None (anonymous
    memory, or less than a page)."""
    if t.device.type != "cpu" or not t.numel():
        return None
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for a, b in file_mappings():
        if a <= start < b:
            first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            last = min(end, b) // mmap.PAGESIZE * mmap.PAGESIZE
            return (first, last - first) if last > first else None
    return None


def drop(t: torch.Tensor) -> int:
    """Give back the resident file pages of a mapped `t` (MADV_DONTNEED); the bytes dropped."""
    pages = file_pages(t)
    if pages is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return pages[1] if libc.madvise(ctypes.c_void_p(pages[0]), ctypes.c_size_t(pages[1]),
                                    mmap.MADV_DONTNEED) == 0 else 0


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return None


def trim() -> None:
    """Return the C heap's free pages to the system (glibc's `malloc_trim`; elsewhere
    nothing). Packing weights one layer after another frees a layer's temporaries (e.g. q, k
    and v joined) between allocations that outlive them, and glibc keeps such holes: 0.7 GiB of
    a full-size float32 tokenizer's 5.2 GB, measured."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)
