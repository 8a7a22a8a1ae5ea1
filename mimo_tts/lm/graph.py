"""The Stage-0 decode step at fixed shapes, captured in CUDA graphs on CUDA devices.

A generation's caches are allocated once by the prefill (static KV caches). Each decode
step then runs over static buffers: the backbone step attends to a fixed span bucket
(64, 128, ... up to the cache length) through a key mask and writes its KV slot through a
device index, and each of the patch decoder's steps runs all B rows. Those are the shapes a
CUDA graph needs: each step is captured the first time it is used and replayed after.
Sampling, the patch encoder and the rest of the glue stay eager. With capture=False the
same formulation runs eagerly (any device), which is how it is tested without a GPU.
`GraphStep` is one implementation of mimo_tts.lm.step.DecodeStep.
Shapes: B batch, S cache length, H hidden, D local_dim, V_c channel vocab.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.step import EagerStep, Slot, mark_keys
from mimo_tts.runtime.cudagraph import capture

SPAN_MIN = 64  # smallest attention span bucket of the backbone step, in groups


def span_buckets(length: int) -> list[int]:
    """Backbone attention spans: powers of two from SPAN_MIN, capped by the cache length."""
    spans, span = [], SPAN_MIN
    while span < length:
        spans.append(span)
        span *= 2
    return spans + [length]


class CapturedStep:
    """A function over static buffers, recorded in a CUDA graph on its first call.

    The first call runs it once on a side stream (kernel choice and workspaces happen outside
    the graph), captures it, then replays it; later calls only replay. Writes the step makes
    (KV cache slots) are idempotent for the same inputs, so the warm-up run is harmless.
    `strict=False` turns a failed capture into a warning and eager calls from then on. Each
    graph keeps its own memory pool (a decode step's intermediates are small), so replaying
    one never overwrites another's outputs, whatever the order.
    """

    def __init__(self, fn: Callable[[], object], strict: bool):
        self.fn, self.strict = fn, strict
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager = False
        self.out = None

    def __call__(self):
        if self.eager:
            return self.fn()
        if self.graph is None:
            try:
                self.graph, self.out = capture(self.fn)
            except RuntimeError as exc:
                if self.strict:
                    raise
                warnings.warn(f"CUDA graph capture of the LM decode step failed ({exc}); "
                              "running it eagerly", RuntimeWarning, stacklevel=2)
                self.eager = True
                return self.fn()
        self.graph.replay()
        return self.out


class GraphStep(EagerStep):
    """Backbone and patch-decoder steps of one generation over static buffers (the new
    groups' embedding and the text logits stay `EagerStep`'s).

    `cache`/`local_cache` are the generation's preallocated caches, `valid` its key mask
    [B, S] or None when no row is padded, `prompt_len` the first free cache slot. The step
    sets keys in `valid` in place, so its owner (a continuous batch refilling a row) sees and
    resets the same mask.
    """

    def __init__(self, model: MiMoAudioLM, cache: KVCache, local_cache: KVCache,
                 valid: Tensor | None, prompt_len: int, *, capture: bool, strict: bool = True):
        weight = model.speech_group_downcast.weight
        device, dtype = weight.device, weight.dtype
        batch, length = cache.k.shape[1], cache.length
        cfg = model.cfg
        self.capture, self.strict = capture, strict
        self.embeds = torch.zeros(batch, 1, cfg.hidden, dtype=dtype, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(batch, dtype=torch.long, device=device)  # each row's slot
        if valid is None:  # no padding: every prompt slot is a key
            valid = (torch.arange(length, device=device) < prompt_len).expand(batch, -1).clone()
        super().__init__(model, cache, local_cache, valid)  # valid [B, S'], S' >= S: a slot a step
        self.spans = span_buckets(length)
        self.local_x = torch.zeros(batch, 1, cfg.local_dim, dtype=dtype, device=device)
        self.backbone_steps: dict[int, Callable] = {}
        self.local_steps: dict[int, Callable] = {}

    def _step(self, fn: Callable[[], object]) -> Callable[[], object]:
        return CapturedStep(fn, self.strict) if self.capture else fn

    def backbone(self, embeds: Tensor, positions: Tensor, slot: Slot) -> Tensor:
        """One backbone position for every row: embeds [B, 1, H], positions [B, 1] written
        at cache `slot` (or row i at slot[i]) -> normed hidden [B, H] (a view of a static
        buffer)."""
        self.embeds.copy_(embeds)
        self.positions.copy_(positions)
        if isinstance(slot, int):
            self.slot.fill_(slot)
        else:
            self.slot.copy_(torch.tensor(slot))
        last = mark_keys(self.valid, slot, self.slot)
        span = next(s for s in self.spans if s > last)
        if span not in self.backbone_steps:
            self.backbone_steps[span] = self._step(functools.partial(self._backbone, span))
        return self.backbone_steps[span]()

    def _backbone(self, span: int) -> Tensor:
        mask = self.valid[:, None, None, :span]  # [B, 1, 1, span]: a view, same address
        hidden = self.model.backbone(self.embeds, self.positions, self.cache, self.slot,
                                     span, mask)
        return hidden[:, -1]

    def local_logits(self, x: Tensor, step: int, channels: Sequence[int]) -> list[Tensor]:
        """Patch-decoder step `step` for x [n, 1, D] (n <= B; all B rows run) -> raw float32
        logits [n, V_c] per channel (views of static buffers until the step runs again)."""
        n = x.shape[0]
        self.local_x[:n].copy_(x)
        if step not in self.local_steps:
            fn = functools.partial(self._local, step, tuple(channels))
            self.local_steps[step] = self._step(fn)
        return [logits[:n] for logits in self.local_steps[step]()]

    def _local(self, step: int, channels: tuple[int, ...]) -> list[Tensor]:
        hidden = self.model.local_step(self.local_x, step, self.local_cache)
        return self.model.local_transformer_lm_heads.logits(channels, hidden)
