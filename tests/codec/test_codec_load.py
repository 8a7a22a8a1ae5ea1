"""Config, strict loading (with broken checkpoint copies), placement and dtypes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimo_tts.codec import CodecConfig, StreamingDecoder, load_audio_tokenizer
from mimo_tts.errors import EXIT_CHECKPOINT, CheckpointError
from mimo_tts.runtime.safetensors import read_config


def test_full_size_config_official_values(tiny_a):
    data = json.loads((tiny_a.parent / "full-size" / "tokenizer-config.json").read_text())
    config = CodecConfig.from_json(data)
    assert config.samples_per_frame == 960 and config.frame_rate == 25.0
    assert (config.n_mels, config.nfft, config.avg_pooler, config.d_model) == (128, 960, 2, 1280)
    assert config.encoder_skip_layer_id == 3 and config.decoder_causal and not config.encoder_causal
    assert config.vocoder_attn_window_size == (40, 10)
    assert config.codebook_size == (1024, 1024) + (128,) * 18
    assert config.vocoder_head_dim == 16 and config.decoder_head_dim == 64


def test_config_missing_field_is_named(tokenizer_dir):
    data = read_config(tokenizer_dir)
    del data["vocoder_dim"]
    with pytest.raises(CheckpointError, match="vocoder_dim"):
        CodecConfig.from_json(data)


def _copy(tokenizer_dir, tmp_path, edit=None):
    """A copy of the tiny checkpoint in tmp_path, its tensors passed through `edit`."""
    target = tmp_path / "tok"
    target.mkdir()
    shutil.copy(tokenizer_dir / "config.json", target / "config.json")
    tensors = load_file(str(tokenizer_dir / "model.safetensors"))
    if edit:
        edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: t.pop("decoder.vocoder.head.out.bias"), "missing 1 tensor(s): decoder.vocoder"),
        (lambda t: t.__setitem__("decoder.extra.weight", torch.zeros(2)),
         "unexpected 1 tensor(s): decoder.extra.weight"),
        (lambda t: t.__setitem__("encoder.conv1.weight", torch.zeros(64, 128, 5)),
         "encoder.conv1.weight (64, 128, 5)"),
        (lambda t: t.pop("encoder.quantizer.vq.layers.7._codebook.embed"),
         "encoder.quantizer.vq.layers.7._codebook.embed"),
    ],
)
def test_strict_loading_names_the_culprit(tokenizer_dir, tmp_path, edit, needle):
    path = _copy(tokenizer_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        load_audio_tokenizer(path)
    assert needle in str(info.value)
    assert info.value.exit_code == EXIT_CHECKPOINT


def test_truncated_safetensors_is_named(tokenizer_dir, tmp_path):
    path = _copy(tokenizer_dir, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_audio_tokenizer(path)


def _shard(tokenizer_dir, tmp_path):
    """Split the checkpoint into two shards with an index, as large checkpoints ship."""
    target = tmp_path / "sharded"
    target.mkdir()
    shutil.copy(tokenizer_dir / "config.json", target / "config.json")
    tensors = load_file(str(tokenizer_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(target / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def test_sharded_checkpoint_loads_identically(tokenizer_dir, tmp_path, codec, decode_cases):
    sharded = load_audio_tokenizer(_shard(tokenizer_dir, tmp_path))
    codes = decode_cases["decode_T37.codes"]
    assert torch.equal(sharded.decode(codes), codec.decode(codes))


def test_missing_shard_is_named(tokenizer_dir, tmp_path):
    path = _shard(tokenizer_dir, tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_audio_tokenizer(path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_audio_tokenizer(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_audio_tokenizer(tmp_path)


def test_meta_default_device_still_runs_on_cpu(tokenizer_dir, codec, decode_cases, encode_cases):
    codes = decode_cases["decode_T37.codes"]
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]
    with torch.device("meta"):
        inside = load_audio_tokenizer(tokenizer_dir, device="cpu")
        wave = inside.decode(codes)
        encoded = inside.encode(torch.stack([audio, audio]), 48000)  # resampling kernel too
        mel = inside.log_mel(audio)
    assert wave.device.type == "cpu" and encoded.device.type == "cpu"
    torch.testing.assert_close(wave, codec.decode(codes), atol=0, rtol=0)
    assert torch.equal(encoded, codec.encode(torch.stack([audio, audio]), 48000))
    assert mel.device.type == "cpu"


def test_a_cpu_tokenizer_under_a_cpu_default_sends_no_call_through_a_device_hook(
        codec, decode_cases, monkeypatch):
    """The device context is entered only where the default device differs: under it every
    torch call goes through a Python hook (thousands a decode); a meta default still gets it."""
    import torch.utils._device as device_module

    hooked = []
    original = device_module.DeviceContext.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        hooked.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(device_module.DeviceContext, "__torch_function__", counting)
    codes = decode_cases["decode_T37.codes"]
    wave = codec.decode(codes)
    for mode in ("incremental", "official"):  # every push of a stream too
        stream = StreamingDecoder(codec, mode=mode)
        stream.push(codes[:, :20])
        stream.push(codes[:, 20:], last=True)
    assert hooked == [], hooked[:5]
    with torch.device("meta"):
        inside = codec.decode(codes)
    assert hooked and torch.equal(inside, wave)


def test_bfloat16_keeps_quantizer_and_istft_in_float32(tokenizer_dir, codec, decode_cases):
    half = load_audio_tokenizer(tokenizer_dir, dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    assert half.model.decoder.layers[0].fc1.weight.dtype == torch.bfloat16
    quantizer = half.model.encoder.quantizer
    assert all(layer._codebook.embed.dtype == torch.float32 for layer in quantizer.vq.layers)
    assert half.model.decoder.vocoder.head.istft.window.dtype == torch.float32
    codes = decode_cases["decode_T37.codes"]
    torch.testing.assert_close(half.dequantize(codes), codec.dequantize(codes), atol=0, rtol=0)
    wave = half.decode(codes)
    assert wave.dtype == torch.float32 and wave.shape == (37 * 960,)
    reference = decode_cases["decode_T37.waveform"]
    error = (wave - reference).norm() / reference.norm()
    assert error < 0.05, error


def test_window_buffer_is_the_loaded_periodic_hann(codec):
    from mimo_tts.codec.vocoder import periodic_hann

    window = codec.model.decoder.vocoder.head.istft.window
    torch.testing.assert_close(window, periodic_hann(960), atol=1e-6, rtol=0)

