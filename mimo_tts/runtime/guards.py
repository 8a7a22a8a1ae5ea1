"""Per-stage safeguards while a model runs: CPU thread budgets and out-of-memory advice.

`thread_budget` gives a block its own torch intra-op thread count (per thread, so Stage-0 and
a Stage-1 worker thread can share the cores); `oom_advice` turns an allocation failure on any
device into a `DeviceError` (exit 4) that says what to try. torch is imported only when used.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from mimo_tts.errors import DeviceError

# Messages of allocation failures: CUDA ("CUDA out of memory"), the CPU allocator ("can't
# allocate memory", "not enough memory"), MPS ("MPS backend out of memory").
_OOM_MARKS = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception from torch is an allocation failure on some device."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(exc, MemoryError) or (oom_type is not None and isinstance(exc, oom_type)):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc).lower() for mark in _OOM_MARKS)


@contextmanager
def oom_advice(stage: str, device: str):
    """Turn an out-of-memory error into a DeviceError (exit 4) with what to try instead."""
    try:
        yield
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        if str(device).startswith("cuda"):  # the allocator's cached blocks back: a clean slate
            import torch

            torch.cuda.empty_cache()
        raise DeviceError(f"out of memory on {device} during {stage}; try --tokenizer-device "
                          "cpu, a smaller --batch-size or a smaller --max-chars") from None


@contextmanager
def thread_budget(threads: int | None):
    """Run the block with `threads` torch intra-op CPU threads in the calling thread only.

    On this torch build (OpenMP + MKL) `torch.set_num_threads` is per thread (the OpenMP ICV and
    MKL's local setting), with one catch: a thread's first parallel op lazily re-applies the
    process-wide value last set by *any* thread. `get_num_threads()` forces that lazy
    initialisation first, so the budget set next is the one this thread keeps.
    """
    if not threads:
        yield
        return
    import torch

    before = torch.get_num_threads()  # also initialises this thread's pool state
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
