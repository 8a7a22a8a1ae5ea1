"""TokenizerService: one tokenizer per (normalised device, realpath, dtype), thread-safe."""

from __future__ import annotations

import threading

import pytest
import torch

from mimo_tts.codec import AudioTokenizer, TokenizerService, load_audio_tokenizer
from mimo_tts.errors import DeviceError

from .conftest import cuda, requires_cuda


class CountingLoader:
    """The real loader, counting calls (slowed a little so threads really overlap)."""

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()

    def __call__(self, path, **kwargs):
        with self._lock:
            self.calls.append((path, kwargs))
        threading.Event().wait(0.05)
        return load_audio_tokenizer(path, **kwargs)


def test_same_key_reuses_one_tokenizer(tokenizer_dir):
    loader = CountingLoader()
    service = TokenizerService(loader)
    first = service.get(tokenizer_dir, "cpu")
    assert isinstance(first, AudioTokenizer)
    assert service.get(str(tokenizer_dir), "CPU", dtype="float32") is first
    assert service.get(tokenizer_dir, torch.device("cpu"), dtype=torch.float32) is first
    assert len(loader.calls) == 1 and len(service) == 1


def test_symlinked_path_shares_the_entry(tokenizer_dir, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tokenizer_dir, target_is_directory=True)
    service = TokenizerService(CountingLoader())
    assert service.get(link, "cpu") is service.get(tokenizer_dir, "cpu")
    assert service.keys()[0][1] == str(tokenizer_dir.resolve())


def test_different_dtype_is_a_different_entry(tokenizer_dir):
    service = TokenizerService(CountingLoader())
    full = service.get(tokenizer_dir, "cpu", dtype=torch.float32)
    half = service.get(tokenizer_dir, "cpu", dtype="bfloat16")
    assert full is not half and half.dtype == torch.bfloat16 and len(service) == 2


def test_concurrent_gets_load_once(tokenizer_dir):
    loader = CountingLoader()
    service = TokenizerService(loader)
    results, barrier = [], threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(service.get(tokenizer_dir, "cpu"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert len(loader.calls) == 1


def test_cuda_graph_flag_is_off_on_cpu(tokenizer_dir):
    service = TokenizerService(CountingLoader())
    assert service.get(tokenizer_dir, "cpu", cuda_graph=True).cuda_graph is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_a_device_error(tokenizer_dir):
    with pytest.raises(DeviceError, match="CUDA is not available"):
        TokenizerService().get(tokenizer_dir, "cuda")


@cuda
@requires_cuda
def test_bare_cuda_shares_current_index(tokenizer_dir):
    service = TokenizerService(CountingLoader())
    current = torch.cuda.current_device()
    assert service.get(tokenizer_dir, "cuda") is service.get(tokenizer_dir, f"cuda:{current}")
    if torch.cuda.device_count() > 1:
        other = 1 - current if current < 2 else 0
        assert service.get(tokenizer_dir, f"cuda:{other}") is not service.get(tokenizer_dir, "cuda")
