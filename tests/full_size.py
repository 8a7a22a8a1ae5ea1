"""Full-size checkpoints without the 20 GB: real names, shapes and official shard layout, with
sparse data (safetensors headers are real; the data is a hole in the file, read as zeros).

The names and shapes come from our own modules built on the meta device from the published
configs, so a test that loads or estimates these goes through the same code as a real checkpoint.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

CODE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
SIZE = {"F32": 4, "BF16": 2, "F16": 2}


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """A safetensors file whose header lists `shapes` (name -> (shape, code)); data is a hole."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, code) in shapes.items():
        count = 1
        for dim in shape:
            count *= dim
        header[name] = {"dtype": code, "shape": list(shape),
                        "data_offsets": [offset, offset + count * SIZE[code]]}
        offset += count * SIZE[code]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)) + blob)
        handle.truncate(8 + len(blob) + offset)
    return offset


def _lm_shapes(config: dict, dtype: str) -> dict:
    import torch

    from mimo_tts.lm.config import LMConfig
    from mimo_tts.lm.model import MiMoAudioLM

    with torch.device("meta"):
        model = MiMoAudioLM(LMConfig.from_json(config))
    return {k: (tuple(v.shape), CODE[dtype]) for k, v in model.state_dict().items()}


def _codec_shapes(config: dict) -> dict:
    from mimo_tts.codec.config import CodecConfig
    from mimo_tts.codec.load import build_model

    model = build_model(CodecConfig.from_json(config))
    shapes = {k: (tuple(v.shape), "F32") for k, v in model.state_dict().items()}
    for name in [k for k in shapes if k.endswith("._codebook.embed")]:  # EMA state, unused
        rows = shapes[name][0][0]
        base = name.removesuffix("embed")
        shapes[base + "embed_avg"] = shapes[name]
        shapes[base + "cluster_size"] = ((rows,), "F32")
        shapes[base + "inited"] = ((1,), "F32")
    return shapes


def write_full_size_lm(directory: Path, config: dict, shards: int = 4) -> Path:
    """The LM as `model-0000N-of-0000M.safetensors` + `model.safetensors.index.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = config.get("torch_dtype", "bfloat16")
    shapes = _lm_shapes(config, dtype)
    total = sum(_bytes(s) for s in shapes.values())
    names, weight_map, written = list(shapes), {}, 0
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        while names and (shard == shards - 1 or written < total * (shard + 1) / shards):
            name = names.pop(0)
            part[name] = shapes[name]
            written += _bytes(shapes[name])
            weight_map[name] = file
        write_sparse_safetensors(directory / file, part)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_full_size_tokenizer(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    write_sparse_safetensors(directory / "model.safetensors", _codec_shapes(config))
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    return directory


def _bytes(entry) -> int:
    shape, code = entry
    count = 1
    for dim in shape:
        count *= dim
    return count * SIZE[code]


def lm_config_cut(config: dict, **dims) -> dict:
    """The published LM config with some dimensions changed (e.g. a 2-layer cut)."""
    return {**config, **dims}


def write_random_lm(directory: Path, config: dict, seed: int = 0) -> int:
    """A real (random) LM checkpoint with the published names in config's torch_dtype; bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
               for name, (shape, _) in _lm_shapes(config, "float32").items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in tensors.values())
