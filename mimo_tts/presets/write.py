"""Random checkpoints in the official on-disk layout that really speak: `tiny` and full size.

`write_random_checkpoint(dir, lm_dims, codec_dims, seed, ...)` writes `dir/lm` (Qwen2-type
MiMo-Audio LM + text tokenizer) and `dir/tokenizer` (MiMo audio tokenizer) with the published
file names, config fields and tensor names (spec §2, §3.7, §4.9), so they load through the same
strict path as the real checkpoints; `write_tiny_preset` and `write_full_size_preset` are its
two sizes. The tensors come from `presets.lm` (with the designed stop circuit) and
`presets.codec`, written by `presets.safetensors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from mimo_tts.presets.codec import FULL_CODEC, TINY_CODEC, codec_config, codec_tensors
from mimo_tts.presets.lm import (
    EOS_TOKEN,
    FULL_LM,
    FULL_VOCAB,
    PAD_TOKEN,
    RESERVED,
    SINK_K,
    SPECIAL_TOKENS,
    TINY_LM,
    build_text_tokenizer,
    lm_config,
    lm_tensors,
    tokenizer_files,
)
from mimo_tts.presets.safetensors import json_bytes, write_file, write_tensors

FULL_SHARDS = 4
# Bumped whenever the weights written for some dims change (cache keys of written checkpoints).
WRITER_VERSION = 2
VOCAB_MULTIPLE = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dims(lm_dims: Mapping, codec_dims: Mapping) -> None:
    if set(lm_dims) != set(TINY_LM) or set(codec_dims) != set(TINY_CODEC):
        raise ValueError("lm_dims / codec_dims need exactly the keys of TINY_LM / TINY_CODEC")
    if lm_dims["num_hidden_layers"] < 2 or lm_dims["hidden_size"] <= len(RESERVED):
        raise ValueError("the control circuit needs >= 2 backbone layers and hidden > 7")
    if lm_dims["input_local_dim"] != lm_dims["local_dim"]:
        raise ValueError("input_local_dim must equal local_dim (no speech_embeddings_to_local)")


def write_random_checkpoint(directory, lm_dims: Mapping = TINY_LM,
                            codec_dims: Mapping = TINY_CODEC, seed: int = 0, *,
                            vocab_size: int | None = None, lm_dtype: torch.dtype = torch.float32,
                            codec_dtype: torch.dtype = torch.float32, shards: int = 1,
                            sink_k: float = SINK_K) -> tuple[Path, Path]:
    """Write a speaking random LM + audio tokenizer of these dimensions under `directory`;
    returns (lm_dir, tokenizer_dir). Deterministic per seed, idempotent.

    vocab_size: the LM's (None: the text tokenizer's size padded to 64); the LM is written in
    `lm_dtype` as `shards` files, the tokenizer in `codec_dtype` as one; `sink_k`: how many audio
    groups each `<|im_start|>` outweighs (huge: the stop circuit never fires)."""
    _check_dims(lm_dims, codec_dims)
    root = Path(directory)
    lm_dir, codec_dir = root / "lm", root / "tokenizer"
    tok = build_text_tokenizer()
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    n_tokens = tok.get_vocab_size(with_added_tokens=True)
    vocab = vocab_size or -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # like the real 151680
    if vocab < n_tokens:
        raise ValueError(f"vocab_size {vocab} < the text tokenizer's {n_tokens} tokens")
    eos, pad = special[EOS_TOKEN], special[PAD_TOKEN]
    cfg = codec_config(codec_dims, _dtype_name(codec_dtype))
    lm_files = {
        "config.json": json_bytes(lm_config(lm_dims, vocab, eos, pad, _dtype_name(lm_dtype))),
        "generation_config.json": json_bytes(
            {"_from_model_config": True, "eos_token_id": eos, "pad_token_id": pad,
             "transformers_version": "4.49.0"}),
        **tokenizer_files(tok),
    }
    for folder, files in ((lm_dir, lm_files), (codec_dir, {"config.json": json_bytes(cfg)})):
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            write_file(folder / name, data)
    write_tensors(lm_dir, lambda gen: lm_tensors(gen, lm_dims, vocab, special, sink_k), seed,
                  lm_dtype, shards)
    write_tensors(codec_dir, lambda gen: codec_tensors(gen, cfg), seed + 1_000_003,
                  codec_dtype)  # independent of the LM stream
    return lm_dir, codec_dir


def write_tiny_preset(directory, seed: int = 0) -> tuple[Path, Path]:
    """Write the tiny preset under `directory`; returns (lm_dir, tokenizer_dir). Idempotent."""
    return write_random_checkpoint(directory, seed=seed)


def write_full_size_preset(directory, seed: int = 0) -> tuple[Path, Path]:
    """The published sizes and layout: LM 8.0 B parameters in bfloat16, four shards + index;
    audio tokenizer 1.3 B in float32 with EMA buffers (about 21 GB, written tensor by tensor)."""
    return write_random_checkpoint(directory, FULL_LM, FULL_CODEC, seed, vocab_size=FULL_VOCAB,
                                   lm_dtype=torch.bfloat16, shards=FULL_SHARDS)
