"""Config parsing and checkpoint loading: strict names/shapes, dtypes, clear errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimo_tts.errors import CheckpointError
from mimo_tts.lm.config import LMConfig
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.sampling import GREEDY


def test_config_from_tiny_checkpoint(lm_dir):
    cfg = LMConfig.from_json(json.loads((lm_dir / "config.json").read_text()))
    assert (cfg.hidden, cfg.backbone.layers, cfg.backbone.heads, cfg.backbone.kv_heads,
            cfg.backbone.head_dim, cfg.backbone.ffn_dim) == (64, 2, 4, 2, 16, 128)
    dec, enc = cfg.patch_decoder, cfg.patch_encoder
    assert (dec.dim, dec.layers, dec.heads, dec.kv_heads, dec.head_dim, dec.ffn_dim) == (
        32, 2, 4, 4, 8, 64)
    assert (enc.dim, enc.layers, enc.ffn_dim, enc.causal, dec.causal) == (32, 1, 128, False, True)
    assert cfg.speech_vocab_sizes == (1025, 1025) + (129,) * 6
    assert cfg.speech_empty_ids == (1024, 1024) + (128,) * 6
    assert cfg.delay_pattern == tuple(range(8)) and cfg.local_steps == 11
    assert dec.rope_theta == enc.rope_theta == cfg.backbone.rope_theta == 640000.0


def test_config_full_size(tiny_a):
    full = json.loads((tiny_a.parent / "full-size" / "lm-config.json").read_text())
    cfg = LMConfig.from_json(full)
    assert (cfg.backbone.head_dim, cfg.backbone.kv_heads, cfg.vocab_size) == (128, 8, 151680)
    assert (cfg.patch_decoder.head_dim, cfg.patch_decoder.kv_heads) == (16, 64)
    assert (cfg.patch_encoder.layers, cfg.patch_encoder.ffn_dim) == (6, 4096)


def test_config_broadcast_defaults_and_errors(lm_dir):
    base = json.loads((lm_dir / "config.json").read_text())
    cfg = LMConfig.from_json({**base, "speech_vocab_size": 129, "speech_zeroemb_idx": 128,
                              "input_local_dim": None,
                              "input_full_attention": None})
    assert cfg.speech_vocab_sizes == (129,) * 8
    assert cfg.input_local_dim == cfg.local_dim and cfg.patch_encoder.causal
    for broken, match in (
        ({k: v for k, v in base.items() if k != "local_dim"}, "local_dim"),
        ({**base, "delay_pattern": "0-1-2"}, "delay_pattern"),
        ({**base, "hidden_size": "big"}, "hidden_size"),
    ):
        with pytest.raises(CheckpointError, match=match):
            LMConfig.from_json(broken)


@pytest.fixture
def lm_copy(lm_dir, tmp_path):
    target = tmp_path / "lm"
    shutil.copytree(lm_dir, target)
    (target / "model.safetensors").chmod(0o644)
    return target


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = dict(load_file(str(path)))
    edit(tensors)
    path.unlink()
    save_file(tensors, str(path))


def test_missing_tensor_is_named(lm_copy):
    _rewrite(lm_copy, lambda t: t.pop("local_transformer.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*local_transformer\.layers\.1"):
        load_lm(lm_copy)


def test_wrong_shape_is_named(lm_copy):
    def edit(t):
        t["speech_group_downcast.weight"] = torch.zeros(64, 64)

    _rewrite(lm_copy, edit)
    with pytest.raises(CheckpointError, match=r"speech_group_downcast\.weight \(64, 64\)"):
        load_lm(lm_copy)


def test_unexpected_tensor_is_named_but_mel_transform_is_ignored(lm_copy):
    def edit(t):
        t["mel_transform.spectrogram.window"] = torch.ones(4)

    _rewrite(lm_copy, edit)
    load_lm(lm_copy)  # known, unused keys are ignored (spec §4.9)
    _rewrite(lm_copy, lambda t: t.update({"extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor.*extra\.weight"):
        load_lm(lm_copy)


def test_missing_config_and_weights_are_named(lm_copy):
    (lm_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_lm(lm_copy)
    (lm_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_lm(lm_copy)


def test_a_bad_config_field_names_the_file(lm_copy):
    """The message of a config error names the checkpoint's config.json (which of the two
    checkpoints, and where), not just the field."""
    path = lm_copy / "config.json"
    cfg = json.loads(path.read_text())
    cfg["local_dim"] = cfg["local_dim"] + 1
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as caught:
        load_lm(lm_copy)
    assert str(caught.value).startswith(f"{path}: local_dim {cfg['local_dim']} is not a multiple")
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))} is not a JSON object"):
        load_lm(lm_copy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(lm_dir, special, case_tensors, forcing, dtype):
    model = load_lm(lm_dir, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.rope_cos.dtype == dtype and model.model.rope_cos.device.type == "cpu"
    t = case_tensors("lm_generate")
    options = GenerationOptions(
        text_sampler=GREEDY, audio_sampler=GREEDY, keep_logits=True,
        text_logits_processor=forcing([[special.empty] * 2 + [special.eostm]]),
    )
    result = generate(model, [t["gen_tts_en_forced.input_ids"]], options, special)[0]
    assert result.text_tokens == [special.empty, special.empty, special.eostm]
    codes = result.new_ids[1:, :8]
    assert (codes < torch.tensor(model.cfg.speech_empty_ids)[:, None]).all()
    # The prefill logits track float32 loosely (logit scale ~5-8); later steps see
    # codes that half precision may sample differently, so they are only checked finite.
    reference = t["gen_tts_en_forced.step_text_logits"][0]
    assert torch.isfinite(result.step_logits).all()
    assert (result.step_logits[0].float() - reference).abs().max() < 0.25


def test_unsupported_dtype(lm_dir):
    with pytest.raises(CheckpointError, match="unsupported LM dtype"):
        load_lm(lm_dir, dtype=torch.int8)


def test_unavailable_device_is_a_device_error(lm_dir):
    from mimo_tts.errors import DeviceError

    with pytest.raises(DeviceError, match="cuda:99"):
        load_lm(lm_dir, device="cuda:99")
