"""The codec's packed float32 linears (mimo_tts/codec/gemm.py): the bf16x3 AMX GEMM (products
against float64, the reference fixtures with it forced on, full-size layers against the plain
float32 path) and oneDNN's blocked layout (`PackedLinear`: the plain products' bytes, the
fixtures, the memory it replaces), the choice between them, the encoder left mapped beside an
LM, and the way back to plain weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mimo_tts.codec import gemm, layers, load_audio_tokenizer
from mimo_tts.codec.int8 import quantize_int8
from mimo_tts.codec.layers import (
    AttnSpec,
    PackedLinear,
    TransformerLayer,
    _packed_gemms,
    plain_state_dict,
    prepack,
    unpack,
    weight_tensors,
)
from mimo_tts.codec.streaming import StreamingDecoder
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
    """The tiny-a tokenizer with the codec kernels forced on, the encoder's layers packed now."""
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 codec_kernel=_placed())
    pending = getattr(codec.model.encoder, "pending_pack", None)
    if pending is not None:
        pending.now()
    return codec


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
    _codes_match_reference(forced, encode_cases, name)


def _codes_match_reference(codec, encode_cases, name: str) -> None:
    """The encoder's hidden states within 1e-4 of the reference's, its codes exactly."""
    audio = encode_cases[f"{name}.waveform_in"]
    torch.testing.assert_close(codec.model.encoder(encode_cases[f"{name}.log_mel"]),
                               encode_cases[f"{name}.encoder_hidden"], atol=1e-4, rtol=0)
    assert torch.equal(codec.encode(audio, 24000), encode_cases[f"{name}.codes_all"].long())


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
    if gemm.library() is not None and gemm.faster().faster:
        decision = gemm.faster()
        assert choice.engine == "bf16x3"
        assert f"{decision.ours} vs {decision.theirs} GFLOP/s" in choice.reason
    elif gemm.onednn_packs():
        assert not choice.active and choice.reason == gemm.onednn_packs()
    else:  # the GEMM cannot run or measured slower: oneDNN's layout, where faster
        decision = gemm.onednn_faster()
        assert choice.engine == ("onednn" if decision.faster else None)
        assert f"{decision.ours} vs {decision.theirs} GFLOP/s" in choice.reason
    assert choice.encoder == choice.active  # nothing beside: the whole tokenizer packs
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    forced = gemm.choose(mode=_placed())
    assert forced.engine == ("bf16x3" if gemm.library() is not None else "onednn")
    assert forced.encoder and "=1" in forced.reason


def test_the_environment_sets_the_onednn_choice(monkeypatch):
    if gemm.library() is not None:
        monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", "codec_gemm=0,codec_packed_float32=1")
    else:
        monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", "codec_packed_float32=1")
    gemm.faster.cache_clear(), gemm.onednn_faster.cache_clear()
    try:
        assert gemm.choose().engine == "onednn"
        monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", "codec_gemm=0,codec_packed_float32=0")
        gemm.faster.cache_clear(), gemm.onednn_faster.cache_clear()
        plain = gemm.choose()
        assert not plain.active and "MIMO_TTS_PRODUCT_CHOICES" in plain.reason
    finally:
        gemm.faster.cache_clear(), gemm.onednn_faster.cache_clear()


def test_bfloat16_layers_are_not_gemm_packed(monkeypatch):
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    layer = TransformerLayer(64, 4, 128).bfloat16().eval().requires_grad_(False)
    prepack(layer, codec_kernel=_placed())
    assert not _packed(layer) and layer.fc1.weight.dtype == torch.bfloat16


def test_beside_an_lm_the_encoder_stays_mapped_where_memory_is_short(monkeypatch, tokenizer_dir):
    """Packing makes the tokenizer's weights anonymous memory: beside CPU LM weights auto packs
    the encoder (read only for a voice prompt) only when both and the headroom fit (here the
    machine is stated to hold 6 GiB), and says so; the decoder, read by every run, packs as
    alone; forced on and the run without an LM on the CPU are not held back."""
    gib = 1 << 30
    monkeypatch.setenv("MIMO_TTS_AVAILABLE_MEMORY", "6GiB")
    monkeypatch.delenv(CODEC_KERNEL_ENV, raising=False)
    alone = gemm.choose(mode=_placed())
    short = gemm.choose(beside=3 * gib, weights=gib // 2, mode=_placed())
    assert short.engine == alone.engine and not short.encoder
    if short.active:
        assert "encoder left mapped" in short.reason and "of 6.0 GiB" in short.reason
    fits = gemm.choose(beside=gib, weights=gib // 2, mode=_placed())
    assert fits.engine == alone.engine and fits.encoder == alone.active
    monkeypatch.setenv(CODEC_KERNEL_ENV, "1")
    assert gemm.choose(beside=3 * gib, weights=gib // 2, mode=_placed()).encoder
    monkeypatch.setenv(CODEC_KERNEL_ENV, "auto")
    plain = load_audio_tokenizer(tokenizer_dir, packing=gemm.PLAIN, codec_kernel=_placed())
    assert not list(_packed_gemms(plain.model))
    engine = "bf16x3" if gemm.library() is not None else "onednn"
    half = load_audio_tokenizer(tokenizer_dir, packing=gemm.Packing(engine, False, "test"))
    decoder = [m for m in half.model.decoder.modules() if isinstance(m, TransformerLayer)]
    encoder = [m for m in half.model.encoder.modules() if isinstance(m, TransformerLayer)]
    assert half.pack_decoder() == (engine == "onednn")  # oneDNN's: left for later (a server)
    assert decoder and all(m.fc1.weight.is_meta and m.self_attn.packed_qkv for m in decoder)
    half.encode(torch.zeros(24000), 24000)  # the encoder stays mapped, also once read
    assert encoder and not any(m.fc1.weight.is_meta or hasattr(m.self_attn, "packed_qkv")
                               for m in encoder)


# ---- oneDNN's blocked float32 layout (every CPU with oneDNN) --------------------------------
needs_onednn = pytest.mark.skipif(bool(gemm.onednn_packs()), reason=gemm.onednn_packs() or "")
ONEDNN = gemm.Packing("onednn", True, "test")


@pytest.fixture(scope="module")
def reordered(tokenizer_dir):
    """The tiny-a tokenizer with every layer in oneDNN's layout, the encoder's and the
    decoder's packed now."""
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 packing=ONEDNN)
    codec.model.encoder.pending_pack.now()
    assert codec.pack_decoder()
    return codec


@pytest.fixture(scope="module")
def plain_codec(tokenizer_dir):
    return load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                packing=gemm.PLAIN)


@needs_onednn
@pytest.mark.parametrize("frames", (4, 37, 101))
def test_reordered_decode_matches_reference_and_the_plain_path(reordered, plain_codec,
                                                               decode_cases, frames):
    codes = decode_cases[f"decode_T{frames}.codes"]
    wave = reordered.decode(codes)
    torch.testing.assert_close(wave, decode_cases[f"decode_T{frames}.waveform"],
                               atol=WAVE_TOL, rtol=0)
    # the same oneDNN products with the reorder done once: equal but for one-row products
    torch.testing.assert_close(wave, plain_codec.decode(codes), atol=1e-6, rtol=0)


@needs_onednn
@pytest.mark.parametrize("name", ["encode_chirp_1p3s", "encode_sines_2p7s"])
def test_reordered_codes_match_reference_exactly(reordered, encode_cases, name):
    _codes_match_reference(reordered, encode_cases, name)


@needs_onednn
def test_reordered_weights_replace_the_plain_ones(reordered, plain_codec):
    """The reordered weights take the float32 weights' place (meta placeholders, opaque
    tensors of the same size) and give back the same values."""
    packed = [p for _, _, p in _packed_gemms(reordered.model)]
    assert packed and all(isinstance(p, PackedLinear) for p in packed)
    layers = [m for m in reordered.model.modules() if isinstance(m, TransformerLayer)]
    assert layers and all(m.fc1.weight.is_meta and m.self_attn.q_proj.weight.is_meta
                          for m in layers)
    plain = plain_codec.model.state_dict()
    meta = [k for k, t in reordered.model.state_dict().items() if t.is_meta]
    assert meta and all(k.endswith(".weight") for k in meta)
    held = weight_tensors(reordered.model)
    reordered_weights = [t for t in held if t.is_mkldnn]
    assert len(reordered_weights) == len(packed)  # q/k/v as one
    assert sum(t.numel() for t in reordered_weights) == sum(plain[k].numel() for k in meta)
    state = plain_state_dict(reordered.model)
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[k], plain[k]) for k in plain)


@needs_onednn
def test_the_encoder_packs_once_enough_audio_went_through(tokenizer_dir, plain_codec,
                                                          encode_cases, monkeypatch):
    """A run that encodes one voice prompt neither packs the encoder nor holds it packed; once
    the encoder has run on ENCODER_PACK_AFTER_S of audio it packs, once, and gives the codes
    it gave plain."""
    monkeypatch.setattr(layers, "ENCODER_PACK_AFTER_S", 2.0)
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 packing=ONEDNN)
    encoder = [m for m in codec.model.encoder.modules() if isinstance(m, TransformerLayer)]
    vocoder = [m for m in codec.model.decoder.vocoder.modules()
               if isinstance(m, TransformerLayer)]
    assert vocoder and all(m.fc1.weight.is_meta for m in vocoder)  # the vocoder packs at load
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]  # 1.3 s a call
    first = codec.encode(audio, 24000)
    assert encoder and not any(m.fc1.weight.is_meta for m in encoder)
    assert torch.equal(codec.encode(audio, 24000), first)  # 1.3 s so far: still plain
    assert not any(m.fc1.weight.is_meta for m in encoder)
    assert torch.equal(codec.encode(audio, 24000), first)  # 2.6 s before it: packed now
    assert all(m.fc1.weight.is_meta and isinstance(m.fc1.packed, PackedLinear) for m in encoder)
    packed = [m.fc1.packed for m in encoder]
    assert torch.equal(codec.encode(audio, 24000), first)
    assert [m.fc1.packed for m in encoder] == packed  # once
    assert torch.equal(first, plain_codec.encode(audio, 24000))


@needs_onednn
def test_the_decoder_packs_once_enough_audio_went_through(tokenizer_dir, plain_codec,
                                                          decode_cases, monkeypatch):
    """A run that speaks a sentence decodes on the mapped weights (packing them would cost it
    more than it saves); once the decoder has run on DECODER_PACK_AFTER_S of audio, through
    whole decodes or stream pushes, it packs, once, here in the middle of a stream, and every
    call gives the plain bytes (a decoder product has two rows or more: `dconv1` doubles the
    frames)."""
    monkeypatch.setattr(layers, "DECODER_PACK_AFTER_S", 2.0)
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 packing=ONEDNN)
    stack = list(codec.model.decoder.layers)
    codes = decode_cases["decode_T37.codes"]  # 1.48 s
    expected = plain_codec.decode(codes)
    assert torch.equal(codec.decode(codes), expected)
    assert not any(m.fc1.weight.is_meta for m in stack)
    longer = decode_cases["decode_T101.codes"]  # its first push of 40 frames passes 2.0 s
    assert torch.equal(_streamed(codec, longer), _streamed(plain_codec, longer))
    assert all(m.fc1.weight.is_meta and isinstance(m.fc1.packed, PackedLinear) for m in stack)
    packed = [m.fc1.packed for m in stack]
    assert torch.equal(codec.decode(codes), expected)
    assert [m.fc1.packed for m in stack] == packed and not codec.pack_decoder()  # once


def _streamed(codec, codes: torch.Tensor) -> torch.Tensor:
    """`codes` pushed 4 frames at a time through an incremental stream -> its audio."""
    stream, ends = StreamingDecoder(codec, mode="incremental"), range(4, codes.shape[1] + 4, 4)
    pieces = [stream.push(codes[:, end - 4:end], last=end >= codes.shape[1]) for end in ends]
    return torch.cat([p for p in pieces if p is not None])


@needs_onednn
def test_encodes_in_threads_while_the_encoder_packs(tokenizer_dir, plain_codec, encode_cases,
                                                    monkeypatch):
    """Encodes from several threads (a server's requests) across the packing: each gets the
    plain codes (`PendingPack.use` keeps calls off the layers while they are swapped)."""
    monkeypatch.setattr(layers, "ENCODER_PACK_AFTER_S", 2.0)
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 packing=ONEDNN)
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]
    expected = plain_codec.encode(audio, 24000)
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: codec.encode(audio, 24000), range(8)))
    assert all(torch.equal(c, expected) for c in codes)
    assert not codec.model.encoder.pending_pack.layers  # packed along the way


@needs_onednn
def test_reordered_products_do_not_depend_on_the_thread_count():
    """What `runtime.fixed_order` needs of a float32 product: the same bytes at any thread
    count, a one-row product too."""
    gen = torch.Generator().manual_seed(5)
    proj = nn.Linear(320, 640).requires_grad_(False)
    packed = PackedLinear([proj])
    before = torch.get_num_threads()
    try:
        for rows in (1, 2, 44):
            x = torch.randn(rows, 320, generator=gen)
            outs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(packed(x, gelu=True))
            assert all(torch.equal(outs[0], out) for out in outs[1:])
    finally:
        torch.set_num_threads(before)


@needs_onednn
def test_a_call_the_packed_form_cannot_serve_is_refused_not_guessed():
    """The plain weights are gone once packed (meta placeholders): a call the packed form does
    not take (here a bfloat16 input) is an error, never a product of the placeholder."""
    proj = nn.Linear(32, 16).requires_grad_(False)
    proj.packed = PackedLinear([proj])
    x = torch.randn(3, 32)
    torch.testing.assert_close(layers.linear(proj, x), proj.packed(x))
    with pytest.raises(RuntimeError, match="packed form only"):
        layers.linear(proj, x.bfloat16())


@needs_onednn
def test_reordered_copy_for_int8_and_back_to_plain(tokenizer_dir, decode_cases):
    codec = load_audio_tokenizer(tokenizer_dir, device="cpu", dtype=torch.float32,
                                 packing=ONEDNN)
    codes = decode_cases["decode_T37.codes"]
    before = codec.decode(codes)
    quantized = quantize_int8(codec)
    assert torch.equal(codec.decode(codes), before) and list(_packed_gemms(codec.model))
    torch.testing.assert_close(quantized.decode(codes), before, atol=0.05, rtol=0)
    unpack(codec.model)
    assert not list(_packed_gemms(codec.model))
    torch.testing.assert_close(codec.decode(codes), before, atol=1e-6, rtol=0)
