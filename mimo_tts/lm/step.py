"""One Stage-0 decode step behind one small interface, and its eager implementation.

A generation group needs four things from the model: the new group's input embedding, one
backbone position, the text logits and the patch decoder's eleven positions. `DecodeStep`
names them; three classes implement it and `generate.decode_step` picks one per generation:

- `EagerStep` (here): the PyTorch modules at the shapes of the call;
- `GraphStep` (mimo_tts/lm/graph.py): fixed shapes over static buffers, captured in CUDA
  graphs on CUDA devices;
- `CpuKernelStep` (mimo_tts/lm/cpu_kernel.py): the fused C kernel on CPU.

The model's modules make no such choice; a step passes them how to multiply (`matmul`) and
how to attend from one query position (`attend`).
Shapes: B batch, n rows of the patch decoder (<= B), H hidden, D local_dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from mimo_tts.lm.model import Attend, KVCache, Matmul, MiMoAudioLM, linear
from mimo_tts.runtime.fixed_order import attend_one

# The backbone cache slot a step writes: one for every row, or one per row.
Slot = int | Sequence[int]


def mark_keys(valid: Tensor, slot: Slot, index: int | Tensor) -> int:
    """Make each row's written slot a key in the mask `valid` [B, S]; -> the last slot written.

    `index` is `slot` as the cache takes it: the int, or the per-row slots as a tensor [B] on
    the mask's device.
    """
    if isinstance(slot, int):
        valid[:, slot] = True
        return slot
    valid[torch.arange(len(slot), device=valid.device), index] = True
    return max(slot)


class DecodeStep(Protocol):
    def embed(self, tokens: Tensor, codes: Tensor, empty_token: int) -> Tensor:
        """New groups: tokens [B], codes [B, F, K] -> backbone input [B, 1, H]."""

    def backbone(self, embeds: Tensor, positions: Tensor, slot: Slot) -> Tensor:
        """embeds [B, 1, H] at positions [B, 1], written at cache `slot` (every row) or at
        slot[i] (row i, a continuous batch) -> hidden [B, H]."""

    def text_logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, H] -> raw text logits [B, V] in float32."""

    def local_logits(self, x: Tensor, step: int, channels: Sequence[int]) -> list[Tensor]:
        """Patch-decoder position `step`: x [n, 1, D] -> raw float32 logits [n, V_c] of each
        channel in `channels`."""


class EagerStep:
    """The model's modules, called at the shapes given. `cache`/`local_cache` are the
    generation's caches, `valid` its key mask [B, S] (None when no row is padded)."""

    def __init__(self, model: MiMoAudioLM, cache: KVCache | None, local_cache: KVCache,
                 valid: Tensor | None = None, matmul: Matmul = linear,
                 attend: Attend = attend_one):
        self.model, self.cache, self.local_cache, self.valid = model, cache, local_cache, valid
        self.matmul, self.attend = matmul, attend

    def embed(self, tokens: Tensor, codes: Tensor, empty_token: int) -> Tensor:
        return self.model.embed_groups(tokens[:, None], codes[:, None], empty_token,
                                       self.matmul)

    def backbone(self, embeds: Tensor, positions: Tensor, slot: Slot) -> Tensor:
        if not isinstance(slot, int):  # a continuous batch: each row over its own keys
            index = torch.tensor(slot, device=embeds.device)
            if self.valid is not None:
                mark_keys(self.valid, slot, index)
            return self.model.backbone(embeds, positions, self.cache, index,
                                       [s + 1 for s in slot], None, self.matmul,
                                       self.attend)[:, -1]
        mask = None
        if self.valid is not None:
            mark_keys(self.valid, slot, slot)
            mask = self.valid[:, None, None, : slot + 1]  # [B, 1, 1, S]: a view, no copy
        return self.model.backbone(embeds, positions, self.cache, slot, slot + 1, mask,
                                   self.matmul, self.attend)[:, -1]

    def text_logits(self, hidden: Tensor) -> Tensor:
        return self.model.text_logits(hidden, self.matmul)

    def local_logits(self, x: Tensor, step: int, channels: Sequence[int]) -> list[Tensor]:
        hidden = self.model.local_step(x, step, self.local_cache, self.matmul)
        return self.model.local_transformer_lm_heads.logits(channels, hidden, self.matmul)
