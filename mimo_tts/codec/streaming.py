"""Streaming decode following the official `MiMoAudioTokenizer.streaming_decode` (spec §7.2).

Each push dequantises the new codes, prepends the cached latent frames and decodes the combined
sequence from scratch. Audio is held back by `right_overlap` frames (the vocoder looks ahead) and
the cache keeps at most `left_overlap` frames once audio has been emitted, so memory stays bounded.
The output totals 960*T samples but differs slightly from one-shot decode (chunk-wide GroupNorm).

`mode="incremental"` (opt-in) hands the stream to `IncrementalDecoder` instead: every frame is
decoded once, with a KV cache and exact vocoder look-ahead (see `incremental.py`); its audio is
closer to one-shot decode than the official scheme's, at about one-shot compute.
`push_streams` pushes several streams at once (the server's Stage-1): incremental streams share
one pass over the decoder's weights, and each gets the samples it gets alone.
Shapes: K codebooks, n new frames, C combined frames, S samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mimo_tts.codec.config import STREAM_MODES
from mimo_tts.codec.incremental import IncrementalDecoder
from mimo_tts.codec.incremental import push_streams as push_incremental
from mimo_tts.errors import UsageError

# Spec §7.2 StreamingConfig defaults, in code frames (10 s and 1.6 s).
LEFT_OVERLAP = 250
RIGHT_OVERLAP = 40


class StreamingDecoder:
    """One stream: push code chunks in order; each push returns new audio or None.

    mode "official" (default) re-decodes with `left_overlap`/`right_overlap` exactly as spec §7.2;
    mode "incremental" ignores the overlaps and passes `options` (context, norm_window, warmup)
    to `IncrementalDecoder`.
    """

    def __init__(self, tokenizer, left_overlap: int = LEFT_OVERLAP,
                 right_overlap: int = RIGHT_OVERLAP, mode: str = "official", **options):
        if mode not in STREAM_MODES:
            raise UsageError(f"streaming mode must be one of {', '.join(STREAM_MODES)}, "
                             f"got {mode!r}")
        if not 0 <= right_overlap <= left_overlap:
            # The kept cache must cover the held-back frames, or the next start goes negative.
            raise UsageError(
                "streaming overlaps need 0 <= right_overlap <= left_overlap, got "
                f"left={left_overlap}, right={right_overlap}"
            )
        if options and mode != "incremental":
            raise UsageError(f"options {sorted(options)} apply to mode='incremental' only")
        self.tokenizer, self.mode = tokenizer, mode
        self.left_overlap, self.right_overlap = int(left_overlap), int(right_overlap)
        self.incremental = IncrementalDecoder(tokenizer, **options) if mode != "official" else None
        self.reset()

    def reset(self) -> None:
        """Start a new stream (drop the cached frames)."""
        self._cache: Tensor | None = None  # [C, d_model] float32 latent frames
        self.processed_length = 0
        if self.incremental is not None:
            self.incremental.reset()

    @property
    def first_audio_frames(self) -> int:
        """The fewest code frames after which a push (not the last) returns audio: official,
        one more than `right_overlap`; incremental, `IncrementalDecoder.first_audio_frames`."""
        if self.incremental is not None:
            return self.incremental.first_audio_frames
        return self.right_overlap + 1

    @property
    def cache_length(self) -> int:
        return 0 if self._cache is None else self._cache.shape[0]

    def push(self, codes: Tensor, last: bool = False) -> Tensor | None:
        """codes [K, n] -> new waveform samples [S] float32 on the tokenizer device, or None."""
        if self.incremental is not None:
            return self.incremental.push(codes, last)
        hidden = self.tokenizer.dequantize(codes)
        if self._cache is not None:
            hidden = torch.cat([self._cache, hidden])
        self._cache = hidden
        combined = hidden.shape[0]
        start = self.processed_length
        spf = self.tokenizer.samples_per_frame
        if last:
            self.processed_length = combined
            return self.tokenizer.decode_hidden(hidden)[start * spf:]
        if combined <= self.right_overlap:
            # Nothing is final yet; the official code decodes and discards, which changes nothing.
            self.processed_length = 0
            return None
        end = combined - self.right_overlap
        wave = self.tokenizer.decode_hidden(hidden)[start * spf:end * spf]
        self.processed_length = end
        if combined > self.left_overlap:
            self._cache = hidden[combined - self.left_overlap:]
            self.processed_length = end - (combined - self.left_overlap)
        return wave


def push_streams(streams: list[StreamingDecoder], codes: list[Tensor],
                 lasts: list[bool]) -> list[Tensor | None]:
    """One push for each of several streams of one tokenizer: what `streams[i].push(codes[i],
    lasts[i])` returns alone. Incremental streams run the decoder stack once over all their
    new frames (`incremental.push_streams`); official ones re-decode their windows in turn."""
    if all(s.incremental is not None for s in streams):
        return push_incremental([s.incremental for s in streams], codes, lasts)
    return [s.push(c, last) for s, c, last in zip(streams, codes, lasts, strict=True)]
