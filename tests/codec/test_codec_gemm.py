"""The float32 bf16x3 AMX GEMM (mimo_tts/codec/gemm.py): products against float64, the
reference fixtures with it forced on, full-size layers against the plain float32 path, the
choice and the way back to plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mimo_tts.codec import gemm, load_audio_tokenizer
from mimo_tts.codec.int8 import quantize_int8
from mimo_tts.codec.layers import (
    AttnSpec,
    TransformerLayer,
    _packed_gemms,
    plain_state_dict,
    prepack,
    unpack,
)
from mimo_tts.errors import UsageError
from mimo_tts.runtime.devices import CODEC_KERNEL_ENV, resolve_placement

needs_amx = pytest.mark.skipif(gemm.library() is None, reason=f"no GEMM: {gemm._build()[1]}")
WAVE_TOL = 1e-4


def _packed(model: nn.Module) -> list[gemm.PackedGemm]:
    return [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None),
                                                           gemm.PackedGemm)]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@needs_amx
@pytest.mark.parametrize(("rows", "inputs", "outputs"), [
    (1, 33, 17), (37, 77, 45), (16, 32, 16), (33, 1280, 100), (500, 96, 1280), (3, 5, 1),
    (40, 2600, 70), (5, 1300, 33)])  # K > 1280: partial sums across passes
@pytest.mark.parametrize("epilogue", ["bias", "none", "gelu", "residual"])
def test_product_matches_float64(rows, inputs, outputs, epilogue):
    gen = torch.Generator().manual_seed(rows * 1000 + inputs)
    proj = nn.Linear(inputs, outputs, bias=epilogue != "none").requires_grad_(False)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(outputs, inputs, generator=gen) / inputs ** 0.5)
    x = torch.randn(2, rows, inputs, generator=gen)[1]  # a view with a storage offset
    residual = torch.randn(rows, outputs, generator=gen) if epilogue == "residual" else None
    weight = proj.weight.double()
    bias = None if proj.bias is None else proj.bias.double()
    ref = F.linear(x.double(), weight, bias)
    ref = F.gelu(ref) if epilogue == "gelu" else ref
    ref = ref + residual.double() if residual is not None else ref
    packed = gemm.PackedGemm(gemm.library(), [proj])
    assert proj.weight.device.type == "meta"  # replaced, not duplicated
    y = packed(x, gelu=epilogue == "gelu", residual=residual)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    # each operand keeps ~16 bits: |error| <= ~3 * 2**-18 * (|x| . |W|^T) per output
    scale = F.linear(x.double().abs(), weight.abs()) + 1e-6 * ref.abs()
    assert ((y.double() - ref).abs() <= 2e-5 * scale).all()
    assert _rel(y, ref) < 1e-5 or inputs < 32
    assert _rel(torch.cat(packed.weights()), weight) < 1e-5  # the plain weights, from hi + lo


@needs_amx
def test_full_size_layer_stays_within_1e5_of_float32():
    torch.manual_seed(0)
    layer = TransformerLayer(1280, 20, 5120).eval().requires_grad_(False)
    x = torch.randn(1, 500, 1280)
    rope = (torch.ones(500, 64), torch.zeros(500, 64))
    plain = layer(x, rope, AttnSpec())
    packed_layer = TransformerLayer(1280, 20, 5120).eval().requires_grad_(False)
    packed_layer.load_state_dict(layer.state_dict())
    packed_layer.prepack(lambda modules: gemm.PackedGemm(gemm.library(), modules))
    assert _rel(packed_layer(x, rope, AttnSpec()), plain.double()) < 1e-5


def _placed() -> str:
    """The codec kernel mode a run's placement resolves (MIMO_TTS_CODEC_KERNEL, else auto)."""
    return resolve_placement(lm_device="cpu", tokenizer_device="cpu").codec_kernel.value


@pytest.fixture
def forced(monkeypatch, tokenizer_dir):
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    return load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                codec_kernel=_placed())


@needs_amx
@pytest.mark.parametrize("frames", (4, 37, 101))
def test_forced_on_decode_matches_reference(forced, decode_cases, frames):
    assert _packed(forced.model)
    wave = forced.decode(decode_cases[f"decode_T{frames}.codes"])
    torch.testing.assert_close(wave, decode_cases[f"decode_T{frames}.waveform"],
                               atol=WAVE_TOL, rtol=0)


@needs_amx
@pytest.mark.parametrize("name", ["encode_chirp_1p3s", "encode_sines_2p7s"])
def test_forced_on_codes_match_reference_exactly(forced, encode_cases, name):
    audio = encode_cases[f"{name}.waveform_in"]
    torch.testing.assert_close(forced.model.encoder(encode_cases[f"{name}.log_mel"]),
                               encode_cases[f"{name}.encoder_hidden"], atol=1e-4, rtol=0)
    assert torch.equal(forced.encode(audio, 24000), encode_cases[f"{name}.codes_all"].long())


@needs_amx
def test_int8_copy_leaves_the_packed_model_alone(forced, decode_cases):
    codes = decode_cases["decode_T37.codes"]
    before = forced.decode(codes)
    state = plain_state_dict(forced.model.decoder)
    assert all(t.device.type == "cpu" for t in state.values())
    quantized = quantize_int8(forced)
    assert torch.equal(forced.decode(codes), before) and _packed(forced.model)
    torch.testing.assert_close(quantized.decode(codes), before, atol=0.05, rtol=0)
    unpack(forced.model)
    assert not _packed(forced.model)
    torch.testing.assert_close(forced.decode(codes), before, atol=1e-5, rtol=0)


def test_forced_off_keeps_the_plain_path(monkeypatch, tokenizer_dir):
    monkeypatch.setenv(CODEC_KERNEL_ENV, "0")
    choice = gemm.choose(mode=_placed())
    assert not choice.active and "off" in choice.reason
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 codec_kernel=_placed())
    assert not _packed(codec.model)
    assert all(p.device.type == "cpu" for p in codec.model.parameters())


def test_choice_modes(monkeypatch):
    monkeypatch.setenv(CODEC_KERNEL_ENV, "maybe")
    with pytest.raises(UsageError, match=CODEC_KERNEL_ENV):
        _placed()
    with pytest.raises(UsageError, match="codec kernel mode"):
        gemm.choose(mode="maybe")
    monkeypatch.setenv(CODEC_KERNEL_ENV, "auto")
    choice = gemm.choose(mode=_placed())
    if gemm.library() is None:
        assert not choice.active and choice.reason == gemm._build()[1]
    else:
        decision = gemm.faster()
        assert choice.active == decision.faster
        assert f"{decision.ours} vs {decision.theirs} GFLOP/s" in choice.reason


def test_bfloat16_layers_are_not_gemm_packed(monkeypatch):
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    layer = TransformerLayer(64, 4, 128).bfloat16().eval().requires_grad_(False)
    prepack(layer, codec_kernel=_placed())
    assert not _packed(layer) and layer.fc1.weight.dtype == torch.bfloat16


@needs_amx
def test_auto_leaves_the_gemm_off_where_memory_is_short(monkeypatch, tokenizer_dir):
    """Packing makes the tokenizer's weights anonymous memory: auto packs beside CPU LM
    weights only when both and the headroom fit (here the machine is stated to hold 6 GiB),
    and says so; forced on and the run without an LM on the CPU are not held back."""
    gib = 1 << 30
    monkeypatch.setenv("MIMO_TTS_AVAILABLE_MEMORY", "6GiB")
    monkeypatch.delenv(CODEC_KERNEL_ENV, raising=False)
    short = gemm.choose(beside=3 * gib, weights=gib // 2, mode=_placed())
    assert not short.active and "of 6.0 GiB" in short.reason
    assert gemm.choose(mode=_placed()).active == gemm.faster().faster  # no LM beside: speed decides
    assert gemm.choose(beside=gib, weights=gib // 2, mode=_placed()).active == gemm.faster().faster
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    assert gemm.choose(beside=3 * gib, weights=gib // 2, mode=_placed()).active
    monkeypatch.setenv(CODEC_KERNEL_ENV, "auto")
    plain = load_audio_tokenizer(tokenizer_dir, use_gemm=False, codec_kernel=_placed())
    assert not list(_packed_gemms(plain.model))
    assert list(_packed_gemms(load_audio_tokenizer(tokenizer_dir, use_gemm=True).model))
