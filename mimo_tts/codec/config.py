"""Architecture of the MiMo-Audio audio tokenizer, read only from its `config.json` (spec §2.1).

The reference class defaults differ from the published checkpoint in almost every field, so
nothing here has a default: a missing field is a CheckpointError that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from mimo_tts.errors import CheckpointError, short_repr

# Spec §7.1: official synthesis decodes independent 60 s chunks with no overlap.
DECODE_CHUNK_FRAMES = 1500
# decode_batch pads sequences together up to this many frames per forward pass (the memory
# preflight bounds Stage-1's workspace by it).
BATCH_FRAMES = 4096

MODEL_TYPE = "mimo_audio_tokenizer"
# The streaming decoders (codec/streaming.py): the official re-decode of overlapping windows
# (spec §7.2) and the incremental one (codec/incremental.py). Here, torch-free, for the options.
STREAM_MODES = ("official", "incremental")


def _bad(name: str, value, what: str) -> CheckpointError:
    return CheckpointError(f"tokenizer config.json: field {name!r} = {short_repr(value)} must "
                           f"be {what}")


def _int(value, name: str, low: int | None = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise _bad(name, value, "an integer")
    if low is not None and value < low:
        raise _bad(name, value, f"an integer >= {low}")
    return int(value)


def _float(value, name: str, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, value, "a finite number")
    if value < 0 or (positive and value == 0):
        raise _bad(name, value, "a number > 0" if positive else "a number >= 0")
    return float(value)


def _typed(name: str, kind: str, value):
    """A config value checked against its field's type (annotation) and range."""
    if kind == "int":
        return _int(value, name)
    if kind == "int | None":
        return None if value is None else _int(value, name, low=0)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _bad(name, value, "true or false")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise _bad(name, value, "a string")
        return value
    if kind == "float":
        return _float(value, name, positive=name != "fmin")
    if kind == "float | None":
        return None if value is None else _float(value, name, positive=True)
    return value  # windows and codebook sizes: checked by their parsers


def _window(value, name: str) -> tuple[int, int]:
    """A flash-attn style (left, right) window; -1 means unbounded (spec §3.2)."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise _bad(name, value, "[left, right]")
    left, right = (_int(v, name, low=-1) for v in value)
    return left, right


def _codebook_sizes(value, num_quantizers: int) -> tuple[int, ...]:
    if isinstance(value, list | tuple):
        sizes = [_int(v, "codebook_size", low=2) for v in value]
    else:
        sizes = [_int(value, "codebook_size", low=2)]
    if len(sizes) == 1:
        sizes = sizes * num_quantizers
    if len(sizes) != num_quantizers:
        raise CheckpointError(
            f"tokenizer config codebook_size has {len(sizes)} entries, "
            f"num_quantizers is {num_quantizers}"
        )
    return tuple(sizes)


# Spec §3.1 step 4: the encoder runs on independent segments of 6000 mel frames (60 s).
SEGMENT_MEL_FRAMES = 6000

@dataclass(frozen=True)
class CodecConfig:
    """Every architecture field of the audio tokenizer's config.json, plus derived rates."""

    sampling_rate: int
    hop_length: int
    nfft: int
    window_size: int
    n_mels: int
    fmin: float
    fmax: float | None
    stride_size: int
    avg_pooler: int
    kernel_size: int
    d_model: int
    activation_function: str
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    encoder_skip_layer_id: int | None
    encoder_causal: bool
    encoder_attn_window_size: tuple[int, int]
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    decoder_kernel_size: int
    decoder_stride_size: int
    decoder_causal: bool
    decoder_attn_window_size: tuple[int, int]
    vocoder_dim: int
    vocoder_intermediate_dim: int
    vocoder_num_layers: int
    vocoder_attention_heads: int
    vocoder_attn_window_size: tuple[int, int]
    vocoder_padding: str
    num_quantizers: int
    codebook_size: tuple[int, ...]
    position_embedding_type: str
    rope_theta: float
    ln_type: str

    @classmethod
    def from_json(cls, data: dict) -> CodecConfig:
        """Build from a parsed config.json; raises CheckpointError naming a missing/bad field."""
        if data.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise CheckpointError(
                f"tokenizer config model_type is {data.get('model_type')!r}, "
                f"expected {MODEL_TYPE!r}"
            )
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise CheckpointError(f"tokenizer config.json lacks field(s): {', '.join(missing)}")
        kinds = {f.name: f.type for f in fields(cls)}
        values = {n: _typed(n, kinds[n], data[n]) for n in names}
        for name in ("encoder_attn_window_size", "decoder_attn_window_size",
                     "vocoder_attn_window_size"):
            values[name] = _window(values[name], name)
        values["codebook_size"] = _codebook_sizes(values["codebook_size"],
                                                  values["num_quantizers"])
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Reject values this implementation does not support, naming the field."""
        checks = [
            (self.activation_function == "gelu", "activation_function must be 'gelu'"),
            (self.position_embedding_type == "rope", "position_embedding_type must be 'rope'"),
            (self.ln_type == "LayerNorm", "ln_type must be 'LayerNorm'"),
            (self.vocoder_padding == "same", "vocoder_padding must be 'same'"),
            (self.d_model % self.encoder_attention_heads == 0,
             "d_model must divide by encoder_attention_heads"),
            (self.d_model % self.decoder_attention_heads == 0,
             "d_model must divide by decoder_attention_heads"),
            (self.vocoder_dim % self.vocoder_attention_heads == 0,
             "vocoder_dim must divide by vocoder_attention_heads"),
            (self.nfft >= self.hop_length and (self.nfft - self.hop_length) % 2 == 0,
             "nfft - hop_length must be even and >= 0 (ISTFT 'same' padding)"),
            (self.window_size == self.nfft, "window_size must equal nfft (ISTFT window)"),
        ]
        for ok, message in checks:
            if not ok:
                raise CheckpointError(f"unsupported tokenizer config: {message}")

    # Derived rates (spec §1, §2.1).
    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per 25 Hz code frame: avg_pooler * stride_size * hop_length (960)."""
        return self.avg_pooler * self.stride_size * self.hop_length

    @property
    def frame_rate(self) -> float:
        """Code frames per second (25.0)."""
        return self.sampling_rate / self.samples_per_frame

    @property
    def mel_rate(self) -> float:
        return self.sampling_rate / self.hop_length

    @property
    def segment_seconds(self) -> float:
        """The audio one encoder segment holds (spec §3.1 step 4: 6000 mel frames, 60 s):
        the longest recording that is one voice prompt."""
        return SEGMENT_MEL_FRAMES / self.mel_rate

    @property
    def mel_frames_per_code(self) -> int:
        """Decoder output (vocoder) frames per code frame: the decoder upsamples x4."""
        return self.samples_per_frame // self.hop_length

    @property
    def encoder_head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    @property
    def vocoder_head_dim(self) -> int:
        return self.vocoder_dim // self.vocoder_attention_heads
