"""runtime/safetensors.py's mapping of checkpoint files: the same tensors as the safetensors
library's loader, built without reading a weight."""

import ctypes
import json
import mmap
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimo_tts.runtime import pages
from mimo_tts.runtime.safetensors import load_tensors, map_file


def _resident_fraction(path) -> float:
    """The share of the file's pages in the page cache (mincore over a fresh mapping)."""
    size = path.stat().st_size
    count = -(-size // mmap.PAGESIZE)
    mapping = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    vec = (ctypes.c_ubyte * count)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(mapping.data_ptr()), ctypes.c_size_t(size), vec) == 0
    return sum(v & 1 for v in vec) / count


def test_mapped_tensors_are_the_librarys_and_views_of_the_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(1 << 18, generator=gen).reshape(512, 512),
               "bf16": torch.randn(3, 5, generator=gen).bfloat16(),
               "f16": torch.randn(7, generator=gen).half(),
               "i64": torch.arange(6).reshape(2, 3), "flag": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "model.safetensors")
    theirs, ours = load_file(tmp_path / "model.safetensors"), load_tensors(tmp_path)
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape
        assert torch.equal(ours[name], t), name
    assert pages.file_pages(ours["f32"]) is not None  # mapped from the file, not copied


def test_building_the_tensors_reads_no_weight(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({f"w{i}": torch.full((1 << 21,), float(i)) for i in range(8)}, path)  # 64 MiB
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident_fraction(path) > 0.05:
        pytest.skip("this file system keeps the file's pages (tmpfs): nothing to measure")
    tensors = map_file(path)
    assert _resident_fraction(path) < 0.05
    assert float(tensors["w3"][-1]) == 3.0  # read on use


def test_an_unaligned_tensor_is_read_right(tmp_path):
    """A header whose length leaves the data off the element size (the library's writer pads
    it; others need not) is copied rather than viewed, and reads the same values."""
    values = torch.arange(10, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [10], "data_offsets": [0, 40]}})
    header += " " * ((8 - len(header) % 8) % 8 + 1)  # one byte off alignment
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + values.numpy().tobytes())
    assert torch.equal(map_file(path)["x"], values)
