"""LM architecture, read only from the checkpoint's config.json (spec §2.2).

The official class defaults differ from the published checkpoints in places, so every field
is required here: a missing or malformed one is a CheckpointError that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mimo_tts.errors import CheckpointError, UsageError, short_repr

# The published LM reads and writes 8 RVQ channels in groups of 4 codec frames (spec §1, §2.2);
# checkpoints state their own (LMConfig); these are for code that has no checkpoint at hand
# (voice-prompt padding, saved-codes files). The one home of both numbers.
GROUP_SIZE = 4
AUDIO_CHANNELS = 8
# Positions the LM may ever hold, prompt included (spec §4.7: GenerationConfig.max_length).
MAX_GROUPS = 8192
# Special tokens that end a generation, by the official task family (spec §4.7); the one home
# of the stop sets: lm.generate and the TTS task specs (mimo_tts.lm.tasks) read them here.
TASK_STOP_TOKENS: dict[str, tuple[str, ...]] = {
    "tts": ("eos", "eostm", "im_end"),
    "spoken_dialogue": ("eos", "eostm", "im_end"),
    "asr": ("eos", "im_end"),
    "audio_understanding": ("eos", "im_end"),
    "text_chat": ("eos", "im_end"),
    "in_context_learning_s2s": ("eos", "eostm"),
}
# Opt-in quantizations of the LM, never the default: "int8" weight-only (mimo_tts/lm/int8.py);
# "w8a8" int8 weights by int8 activations in the CPU kernel (mimo_tts/lm/cpu_kernel.py);
# "w4a8" 4-bit weights in groups of 32 columns by int8 activations, in the same kernel.
LM_QUANTS = ("int8", "w8a8", "w4a8")
KERNEL_QUANTS = ("w8a8", "w4a8")  # the CPU kernel's own: packed at load, bfloat16 models
W4_GROUP = 32  # w4a8: columns per float16 scale of a 4-bit row (cpu_kernel.c, W4_GROUP)
FLOAT32_TINY = 2.0**-126  # the smallest normal float32 (torch.finfo(torch.float32).tiny)


def quant_refusal(quant: str | None, device: str, dtype: str, cpu_kernel: str = "auto") -> str:
    """Why `--lm-quant quant` cannot run on an LM placed on `device` in `dtype` under the CPU
    kernel's mode ("" where it can). The one home of these rules: the run's settings ask it
    before anything loads, `load_lm` and the kernel again on what they were given."""
    if quant is None:
        return ""
    if quant not in LM_QUANTS:
        return f"is not one of {', '.join(LM_QUANTS)}"
    if device != "cpu":
        return f"runs on CPU only, the LM is placed on {device}"
    if quant in KERNEL_QUANTS and dtype != "bfloat16":
        return f"needs bfloat16 weights, the LM is asked in {dtype} (--dtype bfloat16)"
    if quant in KERNEL_QUANTS and cpu_kernel == "off":
        return "runs in the CPU kernel, which is off"
    return ""


@dataclass(frozen=True)
class SamplerConfig:
    """One sampler; temperature 0 means greedy (argmax), top_k None/0 and top_p 1.0 mean off."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        # below float32's smallest normal number the logits cannot be divided by it: its limit
        return self.temperature < FLOAT32_TINY


GREEDY = SamplerConfig()

# Per-task (text, audio) samplers, spec §4.6 (lm/sampling.py samples with them). Only the
# default row sets top_k.
TASK_SAMPLERS: dict[str, tuple[SamplerConfig, SamplerConfig]] = {
    "default": (SamplerConfig(0.6, 50, 0.95), SamplerConfig(0.9, 50, 0.95)),
    "asr": (GREEDY, SamplerConfig(0.9, None, 0.95)),
    "tts": (SamplerConfig(0.6, None, 1.0), SamplerConfig(0.9, None, 0.95)),
    "spoken_dialogue": (SamplerConfig(0.6, None, 0.95), SamplerConfig(0.9, None, 0.95)),
    "audio_understanding": (SamplerConfig(0.3, None, 0.95), SamplerConfig(0.9, None, 0.95)),
    "text_chat": (SamplerConfig(0.4, None, 0.95), SamplerConfig(0.9, None, 0.95)),
    "in_context_learning_s2s": (GREEDY, SamplerConfig(0.9, None, 0.95)),
}


def task_samplers(task: str) -> tuple[SamplerConfig, SamplerConfig]:
    """The (text, audio) samplers of a task name; unknown names get the default row."""
    return TASK_SAMPLERS.get(task, TASK_SAMPLERS["default"])


def _field(cfg: dict, name: str, kind=int):
    """A required field: ints >= 1, floats finite and > 0 (sizes, counts, theta, eps)."""
    if name not in cfg or cfg[name] is None:
        raise CheckpointError(f"LM config.json: missing field {name!r}")
    value = cfg[name]
    shown = short_repr(value)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise CheckpointError(f"LM config.json: field {name!r} = {shown} is not {kind.__name__}")
    try:
        number = float(value)
        if kind is int and number != int(number):
            raise ValueError(value)
        value = kind(number)
    except (TypeError, ValueError, OverflowError):
        raise CheckpointError(
            f"LM config.json: field {name!r} = {shown} is not {kind.__name__}") from None
    if not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"LM config.json: field {name!r} = {shown} must be > 0")
    return value


def _per_channel(cfg: dict, name: str, channels: int) -> tuple[int, ...]:
    """Split "1025-1025-129-..." into ints; a single int broadcasts to every channel."""
    if name not in cfg or cfg[name] is None:
        raise CheckpointError(f"LM config.json: missing field {name!r}")
    raw = cfg[name]
    try:
        if isinstance(raw, int) and not isinstance(raw, bool):
            values = (raw,) * channels
        elif isinstance(raw, str):
            values = tuple(int(part) for part in raw.split("-"))
        else:
            values = tuple(int(v) for v in raw)
    except (TypeError, ValueError):
        raise CheckpointError(f"LM config.json: field {name!r} = {raw!r} is malformed") from None
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise CheckpointError(
            f"LM config.json: field {name!r} has {len(values)} values, expected {channels}"
        )
    return values


@dataclass(frozen=True)
class TransformerConfig:
    """One Qwen2-style stack: the backbone, the patch encoder or the patch decoder."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float
    eps: float
    causal: bool


@dataclass(frozen=True)
class LMConfig:
    """MiMo-Audio LM architecture (spec §2.2, §4.9)."""

    vocab_size: int
    backbone: TransformerConfig
    patch_encoder: TransformerConfig  # input_local_transformer
    patch_decoder: TransformerConfig  # local_transformer
    speech_vocab_sizes: tuple[int, ...]
    speech_empty_ids: tuple[int, ...]
    delay_pattern: tuple[int, ...]
    group_size: int
    audio_channels: int

    @property
    def hidden(self) -> int:
        return self.backbone.dim

    @property
    def local_dim(self) -> int:
        return self.patch_decoder.dim

    @property
    def input_local_dim(self) -> int:
        return self.patch_encoder.dim

    @property
    def local_steps(self) -> int:
        """Patch-decoder steps per group: group_size + max delay (spec §4.4)."""
        return self.group_size + max(self.delay_pattern)

    @classmethod
    def from_json(cls, cfg: dict) -> LMConfig:
        """Build from a parsed config.json; nothing comes from class defaults."""
        theta = _field(cfg, "rope_theta", float)
        eps = _field(cfg, "rms_norm_eps", float)
        hidden = _field(cfg, "hidden_size")
        heads = _field(cfg, "num_attention_heads")
        head_dim = _field(cfg, "head_dim") if cfg.get("head_dim") is not None else hidden // heads
        kv_heads = _field(cfg, "num_key_value_heads")
        if heads % kv_heads or head_dim < 1:
            raise CheckpointError(
                f"LM config.json: num_attention_heads {heads} must be a multiple of "
                f"num_key_value_heads {kv_heads}, with head_dim >= 1")
        backbone = TransformerConfig(
            dim=hidden, layers=_field(cfg, "num_hidden_layers"), heads=heads,
            kv_heads=kv_heads, head_dim=head_dim,
            ffn_dim=_field(cfg, "intermediate_size"), rope_theta=theta, eps=eps, causal=True,
        )
        local_dim = _field(cfg, "local_dim")
        local_heads = _field(cfg, "local_attn_heads")
        if local_dim % local_heads:
            raise CheckpointError(
                f"LM config.json: local_dim {local_dim} is not a multiple of "
                f"local_attn_heads {local_heads}"
            )
        decoder = _local(local_dim, _field(cfg, "local_layers"), local_heads,
                         _field(cfg, "local_ffn_dim"), theta, eps, causal=True)
        in_dim = cfg.get("input_local_dim")
        in_dim = local_dim if in_dim is None else _field(cfg, "input_local_dim")
        if in_dim % local_heads:
            raise CheckpointError(
                f"LM config.json: input_local_dim {in_dim} is not a multiple of "
                f"local_attn_heads {local_heads}"
            )
        # input_full_attention None means causal (spec §2.2); official checkpoints say true.
        full = bool(cfg.get("input_full_attention") or False)
        encoder = _local(in_dim, _field(cfg, "input_local_layers"), local_heads, 4 * in_dim,
                         theta, eps, causal=not full)
        channels = _field(cfg, "audio_channels")
        delays = _per_channel(cfg, "delay_pattern", channels)
        if min(delays) < 0:
            raise CheckpointError(f"LM config.json: negative delay in {delays}")
        sizes = _per_channel(cfg, "speech_vocab_size", channels)
        empty = _per_channel(cfg, "speech_zeroemb_idx", channels)
        if any(not 0 <= e < n for e, n in zip(empty, sizes, strict=True)):
            raise CheckpointError(f"LM config.json: speech_zeroemb_idx {empty} must lie within "
                                  f"speech_vocab_size {sizes}")
        return cls(
            vocab_size=_field(cfg, "vocab_size"), backbone=backbone, patch_encoder=encoder,
            patch_decoder=decoder, speech_vocab_sizes=sizes, speech_empty_ids=empty,
            delay_pattern=delays, group_size=_field(cfg, "group_size"), audio_channels=channels,
        )


def _local(dim, layers, heads, ffn, theta, eps, causal) -> TransformerConfig:
    # The local stacks inherit theta/eps/bias from the full config; their weights fix
    # head_dim = dim / heads and as many KV heads as query heads (spec §2.2).
    return TransformerConfig(dim=dim, layers=layers, heads=heads, kv_heads=heads,
                             head_dim=dim // heads, ffn_dim=ffn, rope_theta=theta, eps=eps,
                             causal=causal)
