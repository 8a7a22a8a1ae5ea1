"""The `tiny` preset: official layout, strict loading, identical rewrites, real speech output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mimo_tts.lm.prompts import pad_prompt_codes
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.presets.lm import SPECIAL_TOKENS
from mimo_tts.presets.write import write_tiny_preset
from mimo_tts.runtime.paths import TEMP_MARK

LM_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return write_tiny_preset(tmp_path_factory.mktemp("tiny") / "preset", seed=0)


def _shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _files(root) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_rewrite_is_byte_identical(tmp_path):
    a = tmp_path / "a"
    write_tiny_preset(a, seed=3)
    first = _files(a)
    write_tiny_preset(a, seed=3)  # in place
    write_tiny_preset(tmp_path / "b", seed=3)  # elsewhere
    assert _files(a) == first == _files(tmp_path / "b")
    assert set(first) == {f"lm/{n}" for n in LM_FILES} | {"tokenizer/config.json",
                                                            "tokenizer/model.safetensors"}
    assert not list(a.rglob(f"{TEMP_MARK}*"))  # no leftovers of the atomic writes
    assert not list(a.rglob("*.tmp")) and not list(a.rglob("*.part"))
    write_tiny_preset(tmp_path / "c", seed=4)
    other = _files(tmp_path / "c")
    assert other["lm/model.safetensors"] != first["lm/model.safetensors"]
    assert other["tokenizer/model.safetensors"] != first["tokenizer/model.safetensors"]
    assert other["lm/tokenizer.json"] == first["lm/tokenizer.json"]


def test_official_layout(preset, tiny_a):
    lm_dir, codec_dir = preset
    assert {p.name for p in lm_dir.iterdir()} == LM_FILES
    cfg = json.loads((lm_dir / "config.json").read_text(encoding="utf-8"))
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["MiMoAudioModel"]
    assert cfg["speech_zeroemb_idx"] == "1024-1024-128-128-128-128-128-128"
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] >= 32
    codec = json.loads((codec_dir / "config.json").read_text(encoding="utf-8"))
    assert codec["model_type"] == "mimo_audio_tokenizer"
    # Same layer counts as tiny-a, so the official tensor names must match it one for one.
    for sub in ("lm", "tokenizer"):
        ours = _shapes((lm_dir if sub == "lm" else codec_dir) / "model.safetensors")
        ref = _shapes(tiny_a / sub / "model.safetensors")
        assert set(ours) == set(ref), sub
    lm = _shapes(lm_dir / "model.safetensors")
    assert lm["lm_head.weight"] == lm["model.embed_tokens.weight"] == (cfg["vocab_size"], 64)
    assert lm["model.layers.0.self_attn.k_proj.weight"] == (32, 64)  # 1 KV head of 32


def test_text_tokenizer(preset):
    lm_dir, _ = preset
    tok = TextTokenizer.from_dir(lm_dir)
    cfg = json.loads((lm_dir / "config.json").read_text(encoding="utf-8"))
    ids = [tok.token_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == 13 and min(ids) >= len(tok) - 13  # appended after the learned BPE
    assert tok.special.eos == tok.special.im_end == cfg["eos_token_id"]
    assert tok.special.pad == tok.special.endoftext == cfg["pad_token_id"]
    assert cfg["vocab_size"] > len(tok) and cfg["vocab_size"] % 64 == 0
    for text in ("Please convert this text to speech: Hello!", "今天天气真好，我们去散步吧。"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode("utf-8"))  # merges were learned


def test_loads_strictly(preset):
    from mimo_tts.codec import load_audio_tokenizer
    from mimo_tts.lm.load import load_lm

    lm_dir, codec_dir = preset
    model = load_lm(lm_dir)
    assert sum(p.numel() for p in model.parameters()) > 100_000
    codec = load_audio_tokenizer(codec_dir)
    codes = torch.stack([torch.arange(40) % (1024 if c < 2 else 128) for c in range(8)])
    wav = codec.decode(codes)
    assert wav.shape == (40 * 960,) and torch.isfinite(wav).all()


@pytest.fixture(scope="module")
def loaded(preset):
    from mimo_tts.codec import load_audio_tokenizer
    from mimo_tts.lm.load import load_lm

    lm_dir, codec_dir = preset
    return load_lm(lm_dir), TextTokenizer.from_dir(lm_dir), load_audio_tokenizer(codec_dir)


def _speak(loaded, task: str, seed: int, **kw):
    """Generate with the TTS default samplers; return (text tokens, codes [8, T] or None)."""
    from mimo_tts.lm.extract import extract
    from mimo_tts.lm.generate import GenerationOptions, generate
    from mimo_tts.lm.prompts import build_prompt
    from mimo_tts.lm.tasks import TASKS

    model, tok, _ = loaded
    empty_ids = list(model.cfg.speech_empty_ids)
    prompt = build_prompt(task, "Hello world, this is a test.", tok, empty_ids, seed=0, **kw)
    options = GenerationOptions.for_task(TASKS[task].sampler, seed=seed, max_new_groups=200)
    gen = generate(model, [prompt.input_ids], options, tok.special)[0]
    out = extract(gen.new_ids, tok, empty_ids, model.cfg.group_size)
    return gen.text_tokens, out.codes


@pytest.mark.parametrize("seed", [0, 1])
def test_plain_tts_speaks_a_few_seconds(loaded, seed):
    _, tok, codec = loaded
    tokens, codes = _speak(loaded, "tts_sft", seed)
    s = tok.special
    assert tokens[-1] == s.eostm and set(tokens[:-1]) == {s.empty}
    assert 12 <= len(tokens) - 1 <= 30  # ~2-5 s of audio
    assert codes.shape == (8, 4 * (len(tokens) - 1))
    assert (codes < torch.tensor(loaded[0].cfg.speech_empty_ids).unsqueeze(1)).all()
    assert len(set(codes[0].tolist())) > codes.shape[1] // 2  # really sampled, not constant
    wav = codec.decode(codes)
    assert wav.shape == (960 * codes.shape[1],) and torch.isfinite(wav).all()
    rms = wav.pow(2).mean().sqrt()
    assert 0.01 < rms < 0.5 and wav.abs().max() < 1.0
    again_tokens, again_codes = _speak(loaded, "tts_sft", seed)  # repeatable per seed
    assert again_tokens == tokens and torch.equal(again_codes, codes)


def test_instruct_layout_also_speaks(loaded):
    tokens, codes = _speak(loaded, "tts_sft_with_instruct", 0, instruct="calm and slow")
    assert tokens[-1] == loaded[1].special.eostm
    assert 12 <= codes.shape[1] // 4 <= 40


@pytest.mark.parametrize("seconds", [1.3, 8.0])
def test_voice_prompt_audio_is_not_counted(loaded, seconds):
    """However long the voice prompt, the clone still speaks a few seconds."""
    codec = loaded[2]
    n = int(24000 * seconds)
    t = torch.arange(n) / 24000
    voice = 0.3 * torch.sin(2 * torch.pi * (200 + 150 * t) * t)  # a chirp
    prompt_codes = pad_prompt_codes(codec.encode_prompt(voice, 24000), 8)
    assert prompt_codes.shape[1] >= 4 * 8  # more groups than some answers
    tokens, codes = _speak(loaded, "tts_sft_with_audio", 0, prompt_codes=prompt_codes)
    assert tokens[-1] == loaded[1].special.eostm
    assert 12 <= codes.shape[1] // 4 <= 40
