"""Output extraction (spec §4.8): generated groups -> text and the codes for synthesis.

Shapes: N generated groups, F frames per group, K codebooks, T frames kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mimo_tts.errors import AudioCheckError


@dataclass(frozen=True)
class Extracted:
    """What one generation produced; `codes` is None when no audio frame was generated."""

    text: str
    codes: Tensor | None  # [K, T] int64 on CPU
    text_tokens: tuple[int, ...]  # one per generated group
    audio_start: int  # first group read as audio
    audio_end: int  # group where audio reading stopped (exclusive)

    @property
    def n_frames(self) -> int:
        return 0 if self.codes is None else self.codes.shape[1]


def extract_text(tokens: Sequence[int], tokenizer) -> str:
    """Decode every group's token but the last (the stop group), keep specials, strip, then
    drop the `<|empty|>`, `<|eot|>` and `<|eostm|>` strings."""
    special = tokenizer.special
    text = tokenizer.decode(list(tokens[:-1]), skip_special_tokens=False).strip()
    for token_id in (special.empty, special.eot, special.eostm):
        text = text.replace(tokenizer.decode([token_id], skip_special_tokens=False), "")
    return text


def extract_codes(new_ids: Tensor, start: int, end: int, empty_ids: Sequence[int],
                  group_size: int) -> Tensor | None:
    """Codes [K, T] of groups start..end, without frames whose channel-0 code is empty."""
    codes = new_ids[1:, start * group_size : end * group_size].long().cpu()  # [K, F * (end-start)]
    if codes.shape[0] != len(empty_ids):
        raise AudioCheckError(f"generated ids have {codes.shape[0]} audio rows, "
                              f"expected {len(empty_ids)}")
    codes = codes[:, codes[0] != empty_ids[0]]
    if codes.shape[1] == 0:
        return None
    limits = torch.tensor(empty_ids).unsqueeze(1)  # [K, 1]
    bad = (codes < 0) | (codes >= limits)
    if bad.any():
        channel, frame = (int(i) for i in bad.nonzero()[0])
        raise AudioCheckError(
            f"generated code {int(codes[channel, frame])} in channel {channel} frame {frame} "
            f"is outside [0, {empty_ids[channel]})"
        )
    return codes


def extract(new_ids: Tensor, tokenizer, empty_ids: Sequence[int], group_size: int) -> Extracted:
    """new_ids [1 + K, F * N] -> Extracted text and codes (None if no audio)."""
    tokens = tuple(int(t) for t in new_ids[0, ::group_size].tolist())
    special = tokenizer.special  # audio: after the first <|sostm|>, before the first <|eostm|>
    start = tokens.index(special.sostm) + 1 if special.sostm in tokens else 0
    end = tokens.index(special.eostm) if special.eostm in tokens else len(tokens)
    codes = extract_codes(new_ids, start, end, empty_ids, group_size)
    return Extracted(extract_text(tokens, tokenizer), codes, tokens, start, end)
