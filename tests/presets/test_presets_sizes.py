"""The preset writer beyond tiny: the full-size plan, the sharded bf16 layout, the streaming
file writer, and the control circuit at non-tiny dimensions (it still speaks, then stops)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from mimo_tts.presets.codec import FULL_CODEC, codec_config, codec_tensors
from mimo_tts.presets.lm import (
    FULL_LM,
    FULL_VOCAB,
    RESERVED,
    SPECIAL_TOKENS,
    TINY_LM,
    build_text_tokenizer,
    lm_tensors,
)
from mimo_tts.presets.safetensors import SafetensorsFile
from mimo_tts.presets.write import write_random_checkpoint

# Intermediate dims: 16x the tiny width and 4x its depth, real head_dim 64 and GQA 4:1.
MID_LM = dict(TINY_LM) | {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                          "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048,
                          "local_dim": 128, "local_layers": 2, "local_attn_heads": 8,
                          "local_ffn_dim": 256, "input_local_dim": 128, "input_local_layers": 2}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small models on a shared 2-core machine: one intra-op thread (tests/conftest.py)."""


def _special() -> dict[str, int]:
    tok = build_text_tokenizer()
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _meta_shapes(tensors) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in tensors}


def test_full_size_plan_matches_the_published_model():
    """The full-size LM and tokenizer, names and shapes only (meta): spec §3.7 and §4.9."""
    from mimo_tts.lm.config import LMConfig
    from mimo_tts.lm.model import MiMoAudioLM
    from mimo_tts.presets.lm import lm_config

    special = _special()
    lm = _meta_shapes(lm_tensors(None, FULL_LM, FULL_VOCAB, special))
    assert len(lm) == 719
    assert sum(math.prod(s) for s in lm.values()) == pytest.approx(8.019e9, rel=5e-4)
    assert lm["model.embed_tokens.weight"] == lm["lm_head.weight"] == (151680, 4096)
    assert lm["model.layers.35.self_attn.k_proj.weight"] == (1024, 4096)
    assert lm["local_transformer.layers.15.self_attn.q_proj.weight"] == (1024, 1024)
    cfg = LMConfig.from_json(lm_config(FULL_LM, FULL_VOCAB, 0, 0, "bfloat16"))
    with torch.device("meta"):
        model = MiMoAudioLM(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == lm  # loads strictly
    codec = _meta_shapes(codec_tensors(None, codec_config(FULL_CODEC)))
    assert len(codec) == 1305
    ema = {k: s for k, s in codec.items() if k.rsplit(".", 1)[-1] in
           ("embed", "embed_avg", "cluster_size", "inited")}
    params = sum(math.prod(s) for k, s in codec.items() if k not in ema)
    assert params == pytest.approx(1284.7e6, abs=0.1e6)
    embeds = sum(math.prod(s) for k, s in ema.items() if k.endswith("._codebook.embed"))
    assert embeds == pytest.approx(5.57e6, abs=0.01e6)


def test_streamed_file_equals_safetensors_save(tmp_path):
    """SafetensorsFile, fed in any order, writes exactly safetensors' own bytes."""
    tensors = dict(lm_tensors(torch.Generator().manual_seed(0), TINY_LM, 512, _special()))
    for dtype in (torch.float32, torch.bfloat16):
        cast = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
        path = tmp_path / f"{dtype}.safetensors"
        f = SafetensorsFile(path, {k: tuple(v.shape) for k, v in cast.items()}, dtype)
        for name in reversed(list(cast)):
            f.put(name, tensors[name])
        f.commit()
        assert path.read_bytes() == save(cast, metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "partial.safetensors", {"a": (2,), "b": (3,)}, torch.float32)
    f.put("a", torch.ones(2))
    with pytest.raises(ValueError, match="never written"):
        f.commit()
    f.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torch.bfloat16.safetensors",
                                                          "torch.float32.safetensors"]


def test_sharded_bf16_layout(tmp_path):
    """Four shards + index (total_size, weight_map), bf16 values equal to one file's."""
    lm4, tok4 = write_random_checkpoint(tmp_path / "four", lm_dtype=torch.bfloat16, shards=4)
    lm1, _ = write_random_checkpoint(tmp_path / "one", lm_dtype=torch.bfloat16)
    index = json.loads((lm4 / "model.safetensors.index.json").read_text())
    shards = [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert sorted(set(index["weight_map"].values())) == shards
    assert not (lm4 / "model.safetensors").exists()
    assert json.loads((lm4 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tok4 / "config.json").read_text())["torch_dtype"] == "float32"
    with safe_open(str(lm1 / "model.safetensors"), "pt") as one:
        total = 0
        for shard in shards:
            with safe_open(str(lm4 / shard), "pt") as f:
                for name in f.keys():
                    assert index["weight_map"][name] == shard
                    t = f.get_tensor(name)
                    assert t.dtype == torch.bfloat16 and torch.equal(t, one.get_tensor(name))
                    total += t.numel() * 2
        assert set(index["weight_map"]) == set(one.keys())
    assert index["metadata"]["total_size"] == total
    write_random_checkpoint(tmp_path / "four", lm_dtype=torch.bfloat16)  # back to one file
    assert not list(lm4.glob("model-*")) and not (lm4 / "model.safetensors.index.json").exists()


@pytest.fixture(scope="module")
def mid(tmp_path_factory):
    """The intermediate model in bfloat16, the dtype the full-size preset ships and runs in."""
    from mimo_tts.lm.load import load_lm
    from mimo_tts.lm.text import TextTokenizer

    lm_dir, _ = write_random_checkpoint(tmp_path_factory.mktemp("mid") / "preset", MID_LM,
                                        lm_dtype=torch.bfloat16)
    return load_lm(lm_dir, dtype="bfloat16"), TextTokenizer.from_dir(lm_dir)


def _speak(mid, task: str, **kw):
    from mimo_tts.lm.generate import GenerationOptions, generate
    from mimo_tts.lm.prompts import build_prompt
    from mimo_tts.lm.tasks import TASKS

    model, tok = mid
    prompt = build_prompt(task, "Hello world, this is a test.", tok,
                          list(model.cfg.speech_empty_ids), seed=0, **kw)
    options = GenerationOptions.for_task(TASKS[task].sampler, seed=0, max_new_groups=80)
    return generate(model, [prompt.input_ids], options, tok.special)[0]


@pytest.mark.parametrize(("task", "kw", "bounds"), [
    ("tts_sft", {}, (12, 30)),
    ("tts_sft_with_instruct", {"instruct": "calm and slow"}, (16, 40)),
])
def test_circuit_speaks_then_stops_at_mid_size(mid, task, kw, bounds):
    """16x wider, 4x deeper than tiny, in bf16: audio groups, then <|eostm|>, as at tiny."""
    generation = _speak(mid, task, **kw)
    tokens, special = generation.text_tokens, mid[1].special
    assert 0 < generation.prefill_s < 60  # timed for the sidecar's pieces[].timings
    assert tokens[-1] == special.eostm and set(tokens[:-1]) == {special.empty}
    assert bounds[0] <= len(tokens) - 1 <= bounds[1]


def _last_layer_noise(model, tok) -> float:
    """Mean norm of the residual's random part (reserved dims apart) entering the last layer,
    over a plain TTS prompt: what the stop head's RMSNorm divides by, besides the circuit."""
    from mimo_tts.lm.generate import GenerationOptions, prefill
    from mimo_tts.lm.prompts import build_prompt

    seen = []

    def grab(module, args):
        x = args[0].float().clone()
        x[..., list(RESERVED)] = 0.0
        seen.append(x.norm(dim=-1).mean().item())

    prompt = build_prompt("tts_sft", "Hello world, this is a test.", tok,
                          list(model.cfg.speech_empty_ids), seed=0)
    hook = model.model.layers[-1].input_layernorm.register_forward_pre_hook(grab)
    try:
        with torch.inference_mode():
            prefill(model, [prompt.input_ids], GenerationOptions(max_new_groups=1), tok.special)
    finally:
        hook.remove()
    return seen[0]


def test_random_parts_keep_the_tiny_norms(mid, tmp_path):
    """The stds shrink with width and depth, so the last layer sees tiny's noise norm (~2.3;
    unscaled, the mid model's would be ~16)."""
    from mimo_tts.lm.load import load_lm
    from mimo_tts.lm.text import TextTokenizer
    from mimo_tts.presets.write import write_tiny_preset

    lm_dir, _ = write_tiny_preset(tmp_path / "tiny")
    tiny = _last_layer_noise(load_lm(lm_dir), TextTokenizer.from_dir(lm_dir))
    assert 1.5 < tiny < 3.5
    assert _last_layer_noise(*mid) == pytest.approx(tiny, rel=0.2)
