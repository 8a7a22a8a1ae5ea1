"""`TokenizerService`: one loaded audio tokenizer per (device, checkpoint, dtype), thread-safe.

Keys follow spec §8 item 1: the device is normalised (`cuda` -> `cuda:<current>`, so `cuda` and
`cuda:0` share an entry while `cuda:0` and `cuda:1` do not) and the checkpoint path is replaced by
its realpath. CUDA-graph use is a speed choice, not part of the key: a later request updates it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from mimo_tts.codec.load import load_audio_tokenizer, resolve_dtype
from mimo_tts.codec.tokenizer import AudioTokenizer
from mimo_tts.runtime.devices import normalize_device

Key = tuple[str, str, torch.dtype]


class TokenizerService:
    """A cache of loaded tokenizers; concurrent `get`s of one key load it exactly once."""

    def __init__(self, loader: Callable[..., AudioTokenizer] = load_audio_tokenizer):
        self._loader = loader
        self._lock = threading.Lock()
        self._key_locks: dict[Key, threading.Lock] = {}
        self._tokenizers: dict[Key, AudioTokenizer] = {}

    @staticmethod
    def key(path: str | Path, device: str | torch.device = "cpu",
            dtype: torch.dtype | str = torch.float32) -> Key:
        """The cache key: (normalised device, realpath of the checkpoint, torch dtype)."""
        return normalize_device(str(device)), os.path.realpath(path), resolve_dtype(dtype)

    def get(self, path: str | Path, device: str | torch.device = "cpu",
            dtype: torch.dtype | str = torch.float32,
            cuda_graph: bool | None = None) -> AudioTokenizer:
        """The cached tokenizer for this key, loading it on first use."""
        key = self.key(path, device, dtype)
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            tokenizer = self._tokenizers.get(key)
            if tokenizer is None:
                device_name, real_path, torch_dtype = key
                tokenizer = self._loader(real_path, device=device_name, dtype=torch_dtype,
                                         cuda_graph=bool(cuda_graph))
                with self._lock:
                    self._tokenizers[key] = tokenizer
            elif cuda_graph is not None:
                tokenizer.cuda_graph = cuda_graph
        return tokenizer

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._tokenizers)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokenizers)

    def clear(self) -> None:
        """Forget every cached tokenizer (their memory is freed once no caller holds them)."""
        with self._lock:
            self._tokenizers.clear()
            self._key_locks.clear()
