"""TTS prompts (spec §6.1, §6.2): a task's segments -> LM input ids [9, 4G].

A prompt is a list of segments. A text segment is tokenised on its own (BPE never merges across
segments) and each token becomes one text group; an audio segment becomes a `<|sosp|>` group, one
group per 4 codec frames and an `<|eosp|>` group (fixtures README §4). What each task takes
lives in `mimo_tts.lm.tasks`. Voice-prompt codes come as the codec gives them and are cut to the
LM's channels and padded to whole groups here (`pad_to_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mimo_tts.errors import InputError
from mimo_tts.lm.config import GROUP_SIZE
from mimo_tts.lm.tasks import (
    SYS_ZH,
    SYS_ZH_CLONE,
    TASKS,
    choose_template,
    preprocess_text,
    validate_inputs,
)
from mimo_tts.lm.text import SpecialTokens, TextTokenizer

IGNORE_ID = -100  # text slots 1..3 of a prompt group (spec §4.2)


@dataclass(frozen=True)
class Segment:
    """One prompt segment: text with its token ids, or audio with its (padded) frame count."""

    kind: str  # "text" | "audio"
    text: str = ""
    token_ids: tuple[int, ...] = ()
    audio_frames: int = 0
    group_size: int = GROUP_SIZE

    @property
    def audio_groups(self) -> int:
        return self.audio_frames // self.group_size

    def render(self) -> str:
        """The segment as shown in `Prompt.rendered` (fixtures' `rendered_prompt` form)."""
        if self.kind == "audio":
            frames, groups = self.audio_frames, self.audio_groups
            return f"<|sosp|>[AUDIO {frames} frames = {groups} groups]<|eosp|>"
        return self.text


@dataclass(frozen=True)
class Prompt:
    """A built prompt: LM input ids [9, 4G] plus the record of how it was made."""

    task: str
    input_ids: torch.Tensor  # [1 + K, 4G] int64
    rendered: str
    segments: tuple[Segment, ...]
    template_index: int | None  # index into the language's template list, None if custom/unused
    template: str | None
    text: str  # after the capitalisation rule
    instruct: str | None
    n_groups: int


def pad_to_groups(codes: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """[K, T] codes, T padded to whole LM groups by repeating the last frame (spec §10.5): the
    one home of this rule."""
    pad = -codes.shape[1] % group_size
    return torch.cat([codes, codes[:, -1:].expand(-1, pad)], dim=1) if pad else codes


def pad_prompt_codes(codes: torch.Tensor, n_channels: int,
                     group_size: int = GROUP_SIZE) -> torch.Tensor:
    """First K rows of [>=K, T] codes, T padded to whole groups by repeating the last frame."""
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise InputError("prompt codes must be a 2-D tensor [K, T]")
    if codes.is_floating_point() or codes.is_complex():
        raise InputError(f"prompt codes must be integers, got {codes.dtype}")
    if codes.shape[0] < n_channels:
        raise InputError(f"prompt codes have {codes.shape[0]} rows, need {n_channels}")
    if codes.shape[1] == 0:
        raise InputError("prompt audio has no codec frames")
    return pad_to_groups(codes[:n_channels].to(device="cpu", dtype=torch.long),
                         group_size)  # [K, T']


def _check_codes(codes: torch.Tensor, empty_ids: Sequence[int]) -> None:
    limits = torch.tensor(list(empty_ids), dtype=torch.long).unsqueeze(1)
    bad = (codes < 0) | (codes >= limits)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise InputError(
            f"prompt code out of range in channel {row}: values must lie in 0..{empty_ids[row] - 1}"
        )


def _pieces(task: str, text: str, instruct, template: str | None, voice) -> list:
    """Segment contents in order (spec §6.2): strings are text segments, tensors audio."""
    if task == "tts_sft":
        user = f"<|im_start|>user\n{template}: {text}<|im_end|>\n"
        return [user, "<|im_start|>assistant\n<|sostm|>"]
    if instruct is not None:
        user = f"<|im_start|>user\n{template}: {text}({instruct})<|im_end|>\n"
    else:  # natural layout (read_text_only=False): the style lives in the text itself
        user = f"<|im_start|>user\n{text}<|im_end|>\n"
    system = [SYS_ZH] if voice is None else [SYS_ZH_CLONE, voice]  # a voice prompt: clone's
    return ["<|im_start|>system\n", *system, "<|im_end|>\n", user,
            "<|im_start|>assistant\n<think>\n"]


def _text_groups(ids: Sequence[int], empty_ids: torch.Tensor, group_size: int) -> torch.Tensor:
    """[1 + K, 4n] for n text tokens: token at frame 0, -100 at frames 1-3, channels empty."""
    n = len(ids)
    text = torch.full((n, group_size), IGNORE_ID, dtype=torch.long)
    text[:, 0] = torch.tensor(list(ids), dtype=torch.long)
    audio = empty_ids.unsqueeze(1).expand(-1, group_size * n)  # [K, 4n]
    return torch.cat([text.reshape(1, -1), audio], dim=0)


def _audio_groups(
    codes: torch.Tensor, special: SpecialTokens, empty_ids: torch.Tensor, group_size: int
) -> torch.Tensor:
    """[1 + K, 4(g + 2)]: a <|sosp|> group, g = T'/4 audio groups, an <|eosp|> group."""
    g = codes.shape[1] // group_size
    text = torch.full((g, group_size), IGNORE_ID, dtype=torch.long)
    text[:, 0] = special.empty
    body = torch.cat([text.reshape(1, -1), codes], dim=0)  # [1 + K, T']
    sosp = _text_groups([special.sosp], empty_ids, group_size)
    eosp = _text_groups([special.eosp], empty_ids, group_size)
    return torch.cat([sosp, body, eosp], dim=1)


def build_prompt(
    task: str,
    text: str,
    tokenizer: TextTokenizer,
    empty_ids: Sequence[int],
    *,
    instruct: str | None = None,
    prompt_codes: torch.Tensor | None = None,
    template: int | str | None = None,
    seed: int | None = None,
    group_size: int = GROUP_SIZE,
) -> Prompt:
    """Build a TTS prompt exactly as the official builder lays it out (spec §6.1-6.2).

    `empty_ids` are the LM's per-channel empty ids (`speech_zeroemb_idx`) and `group_size` its
    frames per group (both from the checkpoint's LMConfig); `prompt_codes` [>=K, T] are
    voice-prompt codes (cut to the LM's K channels and padded here to whole groups by repeating
    the last frame). The template is `template` (index or string) if given, else drawn by
    `random.Random(seed)`; the natural layout uses none.
    """
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    spec = TASKS[task]
    validate_inputs(spec, text, instruct, prompt_codes is not None)
    empty = torch.tensor([int(e) for e in empty_ids], dtype=torch.long)
    voice = None
    if prompt_codes is not None:
        voice = pad_prompt_codes(prompt_codes, len(empty), group_size)
        _check_codes(voice, empty.tolist())
    processed = preprocess_text(text)
    index, chosen = None, None
    if task in ("tts_sft", "tts_sft_with_instruct") or instruct is not None:  # not natural
        index, chosen = choose_template(text, template, seed)
    segments, blocks = [], []
    for piece in _pieces(task, processed, instruct, chosen, voice):
        if isinstance(piece, str):
            ids = tokenizer.encode(piece)
            segments.append(Segment("text", piece, tuple(ids)))
            blocks.append(_text_groups(ids, empty, group_size))
        else:
            segments.append(Segment("audio", audio_frames=piece.shape[1], group_size=group_size))
            blocks.append(_audio_groups(piece, tokenizer.special, empty, group_size))
    input_ids = torch.cat(blocks, dim=1)  # [1 + K, 4G]
    return Prompt(
        task=task,
        input_ids=input_ids,
        rendered="".join(seg.render() for seg in segments),
        segments=tuple(segments),
        template_index=index,
        template=chosen,
        text=processed,
        instruct=instruct,
        n_groups=input_ids.shape[1] // group_size,
    )
