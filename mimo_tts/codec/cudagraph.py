"""CUDA-graph decode in fixed-length buckets (spec §7.8), exact despite the padding.

A latent sequence of T frames is zero-padded to the smallest bucket >= T and decoded with
`lengths = [T]`: GroupNorm statistics, attention keys and the ISTFT envelope all skip the padding
(spec §11.6 is the bug this avoids), so a replay equals eager decode of the unpadded sequence.
Sequences longer than the largest bucket fall back to eager decode. Graphs are captured lazily,
one per bucket, and replays are serialised by a lock (the static buffers are shared).
Shapes: T code frames, d model width, S samples (960 T).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from mimo_tts.runtime.cudagraph import capture

# Spec §7.8: bucket sizes in code frames (the largest is 10.24 s).
BUCKETS = (4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
WARMUP_RUNS = 2


@dataclass
class _Graph:
    graph: object
    hidden: Tensor  # [1, bucket, d] static input
    lengths: Tensor  # [1] static valid length
    wave: Tensor  # [1, 960 * bucket] static output


class GraphDecoder:
    """Bucketed decoder for one device: `padded_eager` (any device) and graph replay (CUDA)."""

    def __init__(self, decoder, device: torch.device, buckets: tuple[int, ...] = BUCKETS):
        self.decoder = decoder
        self.device = torch.device(device)
        self.buckets = tuple(sorted(buckets))
        self.spf = decoder.config.samples_per_frame
        self._graphs: dict[int, _Graph] = {}
        self._lock = threading.Lock()
        self._pool = None

    def supports(self, frames: int) -> bool:
        return 0 < frames <= self.buckets[-1]

    def bucket_for(self, frames: int) -> int:
        return next(b for b in self.buckets if b >= frames)

    @torch.inference_mode()
    def padded_eager(self, hidden: Tensor) -> Tensor:
        """The bucket computation without a graph: latent [T, d] -> waveform [960*T]."""
        frames = hidden.shape[0]
        padded = hidden.new_zeros(1, self.bucket_for(frames), hidden.shape[1])
        padded[0, :frames] = hidden
        lengths = torch.full((1,), frames, dtype=torch.long, device=hidden.device)
        return self.decoder(padded, lengths)[0, : frames * self.spf]

    @torch.inference_mode()
    def __call__(self, hidden: Tensor) -> Tensor:
        """Latent [T, d] (T <= largest bucket) -> waveform [960*T] float32 via graph replay."""
        if self.device.type != "cuda":
            return self.padded_eager(hidden)
        frames = hidden.shape[0]
        with self._lock:
            entry = self._graphs.get(self.bucket_for(frames))
            if entry is None:
                entry = self._capture(self.bucket_for(frames), hidden)
            entry.hidden.zero_()
            entry.hidden[0, :frames].copy_(hidden)
            entry.lengths.fill_(frames)
            entry.graph.replay()
            return entry.wave[0, : frames * self.spf].clone()

    def _capture(self, bucket: int, like: Tensor) -> _Graph:
        dtype = self.decoder.dconv1.conv.weight.dtype
        hidden = torch.zeros(1, bucket, like.shape[1], device=self.device, dtype=dtype)
        lengths = torch.full((1,), bucket, dtype=torch.long, device=self.device)
        with torch.cuda.device(self.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # the warm-up runs build RoPE tables, cuFFT plans and kernels
            graph, wave = capture(lambda: self.decoder(hidden, lengths), warmup=WARMUP_RUNS,
                                  pool=self._pool)
        entry = _Graph(graph, hidden, lengths, wave)
        self._graphs[bucket] = entry
        return entry
