"""Writing checkpoints: small files atomically, safetensors files streamed tensor by tensor.

`write_tensors` takes a function that makes the tensors one at a time (called once on the meta
device for the names and shapes, once for the values), lays out every file's header first and
writes each tensor at its offset, so memory holds one tensor however large the checkpoint; a
sharded checkpoint gets the Hugging Face `model.safetensors.index.json`. Files appear by rename,
and a file whose bytes would not change is left alone. `randn` and `norm_weight` are the seeded
draws the tensor generators of `presets.lm` and `presets.codec` share.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mimo_tts.runtime.paths import atomic_write, create_temp, publish, temp_beside
from mimo_tts.runtime.safetensors import INDEX_FILE

Tensors = Iterator[tuple[str, torch.Tensor]]


def randn(gen: torch.Generator | None, *shape: int, std: float) -> torch.Tensor:
    """A seeded normal draw: every random tensor of `presets.lm` and `presets.codec`."""
    return torch.randn(*shape, generator=gen).mul_(std)


def norm_weight(gen, dim: int) -> torch.Tensor:
    """A norm's weight: 1 plus a little noise."""
    return 1.0 + randn(gen, dim, std=0.05)


def json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def write_file(path: Path, data: bytes) -> None:
    """`data` into `path` atomically (`paths.atomic_write`); identical files (and their mtimes)
    are left alone, so a rewrite is idempotent."""
    atomic_write(path, lambda f: f.write(data), keep_same=True)


ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
WRITE_CHUNK = 1 << 24  # values cast and written at a time


class SafetensorsFile:
    """One safetensors file written in place: the header first (tensors by name, as
    safetensors orders a one-dtype file), then each tensor at its offset, in any order, into a
    temporary file that replaces `path` on `commit()`. Memory: the tensor being written."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype):
        self.path, self.dtype, self.pending = path, dtype, set(shapes)
        header: dict = {"__metadata__": {"format": "pt"}}
        self.offsets, end = {}, 0
        for name in sorted(shapes):
            size = math.prod(shapes[name]) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shapes[name]),
                            "data_offsets": [end, end + size]}
            self.offsets[name], end = end, end + size
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.base = 8 + len(text)
        self.tmp = temp_beside(path)
        self.file = create_temp(self.tmp)
        self.file.write(len(text).to_bytes(8, "little") + text)
        self.file.truncate(self.base + end)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        self.pending.remove(name)
        self.file.seek(self.base + self.offsets[name])
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), WRITE_CHUNK):
            part = flat[start:start + WRITE_CHUNK].to(self.dtype).contiguous()
            self.file.write(part.view(torch.uint8).numpy().data)

    def commit(self) -> None:
        if self.pending:
            raise ValueError(f"{self.path.name}: tensors never written: {sorted(self.pending)}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        publish(self.tmp, self.path, keep_same=True)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def write_tensors(folder: Path, tensors: Callable[[torch.Generator | None], Tensors],
                  seed: int, dtype: torch.dtype, shards: int = 1) -> None:
    """Write `tensors(generator)` to `folder` as `model.safetensors`, or as `shards` files
    `model-0000N-of-0000M.safetensors` (filled in order, about equal in size) plus
    `model.safetensors.index.json`. The names and shapes come first, from a meta-device pass."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in tensors(None)}
    sizes = {name: math.prod(shape) * dtype.itemsize for name, shape in shapes.items()}
    total, filled, where = sum(sizes.values()), 0, {}
    for name in shapes:  # production order: embeddings, layers, heads (like HF's shards)
        shard = min(shards - 1, filled * shards // total)
        where[name] = (f"model-{shard + 1:05d}-of-{shards:05d}.safetensors" if shards > 1
                       else "model.safetensors")
        filled += sizes[name]
    files = {}
    try:
        for file in sorted(set(where.values())):
            files[file] = SafetensorsFile(folder / file, {n: shapes[n] for n in shapes
                                                          if where[n] == file}, dtype)
        for name, tensor in tensors(torch.Generator().manual_seed(seed)):
            files[where[name]].put(name, tensor)
            del tensor  # freed before the next one is made: one tensor at a time
        for f in files.values():
            f.commit()
    except BaseException:
        for f in files.values():
            f.discard()
        raise
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
        write_file(folder / INDEX_FILE, json_bytes(index))
    keep = set(files) | ({INDEX_FILE} if shards > 1 else set())
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:
        if old.name not in keep:
            old.unlink(missing_ok=True)  # another layout written here before
