"""runtime/pages.py: the file pages of mapped weights, dropped once a kernel packed them;
anonymous memory is never advised."""

import mmap

import torch

from mimo_tts.runtime import pages


def _mapped(tmp_path, values):
    path = tmp_path / "w.bin"
    path.write_bytes(values.numpy().tobytes())
    return torch.from_file(str(path), shared=False, size=values.numel())


def test_only_a_file_mappings_whole_pages_are_found(tmp_path):
    values = torch.randn(1 << 20)
    mapped = _mapped(tmp_path, values)
    start, length = pages.file_pages(mapped)
    assert start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert mapped.data_ptr() <= start and start + length <= mapped.data_ptr() + 4 * (1 << 20)
    assert length >= 4 * (1 << 20) - 2 * mmap.PAGESIZE
    assert pages.file_pages(values.clone()) is None
    assert pages.file_pages(mapped[:16]) is None  # less than a page


def test_dropping_pages_keeps_values(tmp_path):
    """File-mapped weights read back the file after their pages are dropped; anonymous memory
    (which would read back zeros) is never dropped."""
    values = torch.randn(1 << 20)
    mapped = _mapped(tmp_path, values)
    anonymous = values.clone()
    assert pages.drop(mapped) > 0 and pages.drop(anonymous) == 0
    for t in (mapped, anonymous):
        assert torch.equal(t, values)

