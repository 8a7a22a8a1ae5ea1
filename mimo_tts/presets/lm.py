"""The LM half of a random checkpoint that speaks: its tensors (spec §4.9 names), the designed
stop circuit, the text tokenizer files and config.json.

Random weights alone never emit `<|empty|>` then `<|eostm|>`, so the backbone carries a small
hand-built control circuit on seven reserved residual dimensions (no layer writes them otherwise):
- BIAS: a constant on every group (text embeddings; audio groups via a constant patch-encoder
  feature, the reserved patch dimension E0 that every speech embedding sets and no layer writes);
- AUDIO: set on audio groups only; MARK: set on `<|im_start|>` only;
- STOP: written by head 0 of the last layer, which attends with position-independent scores
  (one low-frequency RoPE pair): 0 on generated audio groups, ln(K) on `<|im_start|>`, very low
  on other text and on prompt audio, and whose value is the audio indicator. STOP is then
  n / (n + K m) for n audio groups and m `<|im_start|>` tokens: the audio fraction grows as
  speech is generated.
- BRACKET/SIGN/INSIDE: head 0 of layer 0 attends to `<|sosp|>` and `<|eosp|>` (BRACKET) and
  averages SIGN (+1 / -1): INSIDE is 1 between them, so a voice prompt's audio is not counted.
`lm_head` reads only BIAS and STOP: `<|empty|>` wins until the fraction nears 1/2, then
`<|eostm|>` takes over within a few groups (plain prompt: ~13-24 groups, 2-4 s; the instruct and
natural layouts hold three `<|im_start|>`: ~23-33 groups); every other token is far below.
The designed heads read RMS-normed residuals, so the random parts' norms must stay those of the
tiny model the constants were tuned at (REFERENCE): their stds shrink as sqrt(width) and, for
stacked layers, as sqrt(depth) grow (`_shrink`; 1 at the tiny dims).
Codes come from the random patch decoder (the empty id is masked, so codes stay in range).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from mimo_tts.lm.sampling import TASK_SAMPLERS
from mimo_tts.lm.tasks import SYS_ZH, SYS_ZH_CLONE, TTS_EN_TEMPLATES, TTS_ZH_TEMPLATES
from mimo_tts.presets.safetensors import Tensors, json_bytes, norm_weight, randn

TINY_LM = MappingProxyType({  # backbone head_dim 32 (2 heads): usable for fused-attention engines
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128,
    "local_dim": 32, "local_layers": 2, "local_attn_heads": 4, "local_ffn_dim": 64,
    "input_local_dim": 32, "input_local_layers": 1,
})
# The published dimensions (spec §2.2; tests/fixtures/full-size/lm-config.json).
FULL_LM = MappingProxyType({
    "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 11008,
    "local_dim": 1024, "local_layers": 16, "local_attn_heads": 64, "local_ffn_dim": 4096,
    "input_local_dim": 1024, "input_local_layers": 6,
})
FULL_VOCAB = 151680  # the published LM's vocab_size
REFERENCE = TINY_LM  # the dims the circuit's constants were tuned at
SPEECH_VOCAB = (1025, 1025, 129, 129, 129, 129, 129, 129)  # spec §2.2 (real values)
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|sosp|>", "<|eosp|>", "<|empty|>",
    "<|Human|>", "<|SpeechLM|>", "<|sostm|>", "<|eostm|>", "<|eot|>", "<think>", "</think>",
)
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
BPE_VOCAB = 448  # learned tokens (256 bytes + merges); the LM vocab pads past the specials
# Qwen2's pre-tokenizer split pattern (a fact of the published tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = (  # BPE training text: the prompt templates plus a few sentences of each language
    " ".join(TTS_EN_TEMPLATES) + ".",
    " ".join(TTS_ZH_TEMPLATES),
    SYS_ZH + SYS_ZH_CLONE + "今天天气真好，我们一起去公园散步吧。我很高兴认识你，欢迎来到这里。",
    "system\nuser\nassistant\n The quick brown fox jumps over the lazy dog near the river bank. "
    "Hello world! Welcome to the MiMo audio demo, it is nice to meet you. Speak slowly in a "
    "warm and gentle female voice; whisper, happy, sad, fast, 1234567890.",
)

# Control circuit (see the module docstring). Residual dims of the backbone, dim of the patches.
BIAS, AUDIO, MARK, STOP, BRACKET, SIGN, INSIDE = range(7)
RESERVED = (BIAS, AUDIO, MARK, STOP, BRACKET, SIGN, INSIDE)
E0 = 0
C_BIAS, C_AUDIO, C_MARK, C_STOP, C_BRACKET, C_INSIDE = 6.0, 2.0, 2.0, 1.0, 2.0, 2.0
SINK_K = 13.0  # each <|im_start|> weighs as much as K audio groups
OTHER_TEXT_SCORE = -12.0  # attention score of ordinary tokens in the designed heads
BRACKET_SCORE = 8.0  # score of <|sosp|>/<|eosp|> in the bracket head
STOP_SLOPE = 40.0  # d(eostm - empty logit)/d(fraction), after the TTS text temperature
STOP_AT = 0.5  # fraction at which P(eostm) = P(empty)
TTS_TEXT_TEMPERATURE = TASK_SAMPLERS["tts"][0].temperature  # spec §4.6, the "tts" text sampler
EMPTY_LOGIT_SCALE, OTHER_LOGIT_SCALE = 2.0, -2.0


def _shrink(dims: Mapping, width: str, depth: str | None = None) -> float:
    """Std factor (1 at REFERENCE) that keeps a random part's norm as at REFERENCE: a random
    vector's norm grows as sqrt(width), a sum of stacked layers' outputs as sqrt(depth)."""
    ratio = REFERENCE[width] / dims[width]
    if depth is not None:
        ratio *= REFERENCE[depth] / dims[depth]
    return math.sqrt(ratio)


def _stack(gen, prefix: str, layers: int, dim: int, heads: int, kv: int, ffn: int,
           reserved: tuple[int, ...] = (), out_std: float = 0.5, hd: int | None = None,
           design: Callable[[int, dict], None] | None = None) -> Tensors:
    """Random Qwen2-style layers (spec §4.9 names), layer by layer; rows `reserved` of every
    writer are zero, then `design(i, tensors)` edits layer i."""
    hd = hd or dim // heads  # the local stacks' head_dim is dim / heads (spec §2.2)
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        w: dict[str, torch.Tensor] = {}
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            w[p + f"self_attn.{name}.weight"] = randn(gen, rows, dim, std=dim**-0.5)
            w[p + f"self_attn.{name}.bias"] = randn(gen, rows, std=0.02)
        o_std = out_std / heads / hd**0.5
        w[p + "self_attn.o_proj.weight"] = randn(gen, dim, heads * hd, std=o_std)
        w[p + "mlp.gate_proj.weight"] = randn(gen, ffn, dim, std=dim**-0.5)
        w[p + "mlp.up_proj.weight"] = randn(gen, ffn, dim, std=dim**-0.5)
        w[p + "mlp.down_proj.weight"] = randn(gen, dim, ffn, std=out_std / ffn**0.5)
        w[p + "input_layernorm.weight"] = norm_weight(gen, dim)
        w[p + "post_attention_layernorm.weight"] = norm_weight(gen, dim)
        for writer in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w[p + writer][list(reserved)] = 0.0
        w[p + "input_layernorm.weight"][list(reserved)] = 1.0
        if design is not None:
            design(i, w)
        yield from w.items()
    norm = norm_weight(gen, dim)
    norm[list(reserved)] = 1.0
    yield prefix + "norm.weight", norm


def _designed_head(w: dict, dims: Mapping, layer: int, key: dict[int, float],
                   value: dict[int, float], out: tuple[int, float]) -> None:
    """Make head 0 of `layer` attend by `key` (coefficients on the normed residual) alone.

    Its query is a constant on the lowest-frequency RoPE pair (~0.03 rad over 8192 positions at
    theta 640000), so the scores ignore position; no other head reads that pair. Value row 0
    reads `value`, and o_proj copies it into residual dim out[0] with gain out[1].
    """
    hd = dims["head_dim"]
    p = f"model.layers.{layer}.self_attn."
    rot = [hd // 2 - 1, hd - 1]
    for head in range(dims["num_attention_heads"]):
        w[p + "q_proj.weight"][[head * hd + j for j in rot]] = 0.0
        w[p + "q_proj.bias"][[head * hd + j for j in rot]] = 0.0
    w[p + "q_proj.weight"][:hd] = 0.0
    w[p + "q_proj.bias"][:hd] = 0.0
    w[p + "q_proj.bias"][rot[0]] = math.sqrt(hd)  # cancels the 1/sqrt(head_dim) of the score
    for name, row, coeffs in (("k_proj", rot[0], key), ("v_proj", 0, value)):
        w[p + f"{name}.weight"][row] = 0.0
        w[p + f"{name}.weight"][row, list(coeffs)] = torch.tensor(list(coeffs.values()))
        w[p + f"{name}.bias"][row] = 0.0
    w[p + "k_proj.weight"][rot[1]] = 0.0
    w[p + "k_proj.bias"][rot[1]] = 0.0
    w[p + "o_proj.weight"][out[0], 0] = out[1]


def _control_heads(w: dict, layer: int, dims: Mapping, sink_k: float) -> None:
    """Layer 0: the voice-prompt bracket -> INSIDE. Last layer: the audio fraction -> STOP.

    An RMSNorm input x reads x * sqrt(H) / |x|; the coefficients divide that back out for the
    nominal |x| of each kind of group, so scores and values come out as named constants.
    """
    root_h = math.sqrt(dims["hidden_size"])
    zeta = OTHER_TEXT_SCORE / root_h  # ordinary tokens: zeta * C_BIAS * sqrt(H) / |x| ~ -12
    if layer == 0:
        bracket_norm = math.sqrt(C_BIAS**2 + 2 * C_BRACKET**2)
        bracket = (BRACKET_SCORE * bracket_norm / root_h - zeta * C_BIAS) / C_BRACKET
        _designed_head(w, dims, 0, {BIAS: zeta, BRACKET: bracket},
                       {SIGN: bracket_norm / (root_h * C_BRACKET)}, (INSIDE, C_INSIDE))
    if layer == dims["num_hidden_layers"] - 1:
        alpha = -zeta * C_BIAS / C_AUDIO  # generated audio: (zeta*c + alpha*c_a) * ... = 0
        mark = (math.log(sink_k) * math.hypot(C_BIAS, C_MARK) / root_h - zeta * C_BIAS) / C_MARK
        inside = zeta * C_BIAS / C_INSIDE  # prompt audio drops to the ordinary-token score
        audio_norm = root_h * C_AUDIO / math.hypot(C_BIAS, C_AUDIO)  # AUDIO after the RMSNorm
        _designed_head(w, dims, layer, {BIAS: zeta, AUDIO: alpha, MARK: mark, INSIDE: inside},
                       {AUDIO: 1.0 / audio_norm}, (STOP, C_STOP))


def _lm_head(gen, dims: Mapping, vocab: int, empty: int, eostm: int) -> torch.Tensor:
    """Text logits: <|empty|> vs <|eostm|> by the audio fraction; every other token far below."""
    h = dims["hidden_size"]
    head = randn(gen, vocab, h, std=0.02 * _shrink(dims, "hidden_size"))
    head[:, list(RESERVED)] = 0.0
    head[:, BIAS] = OTHER_LOGIT_SCALE
    h_bias = math.sqrt(h) * C_BIAS / math.sqrt(C_BIAS**2 + C_AUDIO**2 + (C_STOP * STOP_AT) ** 2)
    gain = STOP_SLOPE * TTS_TEXT_TEMPERATURE * C_BIAS / (h_bias * C_STOP)
    head[empty] = 0.0
    head[empty, BIAS] = EMPTY_LOGIT_SCALE
    head[eostm] = 0.0
    head[eostm, BIAS] = EMPTY_LOGIT_SCALE - gain * C_STOP * STOP_AT / C_BIAS
    head[eostm, STOP] = gain
    return head


def _embeddings(gen, dims: Mapping, vocab: int, special: dict[str, int]) -> torch.Tensor:
    emb = randn(gen, vocab, dims["hidden_size"], std=0.15 * _shrink(dims, "hidden_size"))
    emb[:, list(RESERVED)] = 0.0
    emb[:, BIAS] = C_BIAS
    emb[special["<|im_start|>"], MARK] = C_MARK
    for token, sign in (("<|sosp|>", 1.0), ("<|eosp|>", -1.0)):
        emb[special[token], BRACKET] = C_BRACKET
        emb[special[token], SIGN] = sign * C_BRACKET
    return emb


def _speech_weights(gen, dims: Mapping) -> Tensors:
    """Speech embeddings (shared by both patch stacks), local heads and the two downcasts."""
    h, d, g = dims["hidden_size"], dims["local_dim"], 4
    narrow = _shrink(dims, "local_dim")
    for c, size in enumerate(SPEECH_VOCAB):
        emb = randn(gen, size, d, std=0.1 * narrow)
        emb[:, E0] = 0.5  # 8 channels -> 4.0 on E0, dominating the patch RMSNorm
        yield f"speech_embeddings.{c}.weight", emb
        yield f"local_transformer_lm_heads.{c}.weight", randn(gen, size, d, std=0.3 * narrow)
    down = randn(gen, h, g * d, std=0.3 * _shrink(dims, "hidden_size") / math.sqrt(g * d))
    down[list(RESERVED)] = 0.0
    e0_out = math.sqrt(d)  # E0 after the patch encoder's RMSNorm when it dominates
    for frame in range(g):
        down[BIAS, frame * d + E0] = C_BIAS / (g * e0_out)
        down[AUDIO, frame * d + E0] = C_AUDIO / (g * e0_out)
    yield "speech_group_downcast.weight", down
    yield "hidden_states_downcast.weight", randn(gen, d, h, std=h**-0.5)


def lm_tensors(gen: torch.Generator | None, dims: Mapping, vocab: int, special: dict[str, int],
               sink_k: float = SINK_K) -> Tensors:
    """Every LM tensor by its official name (spec §4.9), float32, one at a time (a layer's
    tensors at once), deterministic per generator; `gen` None under torch.device("meta"):
    the same names and shapes, no values."""
    c = dims
    yield "model.embed_tokens.weight", _embeddings(gen, c, vocab, special)
    yield from _stack(gen, "model.", c["num_hidden_layers"], c["hidden_size"],
                      c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"],
                      RESERVED, 0.3 * _shrink(c, "hidden_size", "num_hidden_layers"),
                      c["head_dim"], lambda i, w: _control_heads(w, i, c, sink_k))
    yield "lm_head.weight", _lm_head(gen, c, vocab, special["<|empty|>"], special["<|eostm|>"])
    heads = c["local_attn_heads"]
    yield from _stack(gen, "input_local_transformer.", c["input_local_layers"],
                      c["input_local_dim"], heads, heads, 4 * c["input_local_dim"], (E0,),
                      out_std=0.3 * _shrink(c, "input_local_dim", "input_local_layers"))
    yield from _stack(gen, "local_transformer.", c["local_layers"], c["local_dim"], heads, heads,
                      c["local_ffn_dim"])
    yield from _speech_weights(gen, c)


def build_text_tokenizer():
    """A byte-level BPE (Qwen2-style split + NFC) trained on a fixed corpus, specials appended."""
    import tokenizers as tk

    pre = tk.pre_tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.normalizer = tk.normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence([
        pre.Split(tk.Regex(QWEN2_SPLIT), behavior="isolated"),
        pre.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, show_progress=False, initial_alphabet=pre.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    tok.add_special_tokens([tk.AddedToken(t, normalized=False, special=True)
                            for t in SPECIAL_TOKENS])
    return tok


def tokenizer_files(tok) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json (HF layout)."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {
        "added_tokens_decoder": {str(ids[t]): {"content": t, **flags, "special": True}
                                 for t in SPECIAL_TOKENS},
        "additional_special_tokens": list(SPECIAL_TOKENS), "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": EOS_TOKEN, "errors": "replace",
        "model_max_length": 131072, "pad_token": PAD_TOKEN, "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": [{"content": t, **flags} for t in SPECIAL_TOKENS],
        "eos_token": {"content": EOS_TOKEN, **flags},
        "pad_token": {"content": PAD_TOKEN, **flags},
    }
    return {
        "tokenizer.json": json_bytes(json.loads(tok.to_str())),
        "tokenizer_config.json": json_bytes(config),
        "special_tokens_map.json": json_bytes(special_map),
    }


def lm_config(dims: Mapping, vocab: int, eos: int, pad: int, dtype: str = "float32") -> dict:
    """config.json of the LM: Qwen2 fields plus the MiMo-Audio fields (spec §2.2)."""
    return {
        "architectures": ["MiMoAudioModel"], "model_type": "qwen2",
        "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
        **dims,
        "max_position_embeddings": 8192, "max_window_layers": 28, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 640000.0, "sliding_window": 4096,
        "use_sliding_window": False, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": vocab, "eos_token_id": eos, "pad_token_id": pad,
        "audio_channels": 8, "group_size": 4, "delay_pattern": "0-1-2-3-4-5-6-7",
        "speech_vocab_size": "-".join(str(v) for v in SPEECH_VOCAB),
        "speech_zeroemb_idx": "-".join(str(v - 1) for v in SPEECH_VOCAB),
        "local_attn_dropout": 0.1, "input_full_attention": True,
        "torch_dtype": dtype, "transformers_version": "4.49.0",
    }
