"""The tokenizer's fused CPU attention (mimo_tts/codec/attention.py, attention.c): exact to a
float64 softmax over the keys each query sees, the same bytes whatever the threads, the batch
or the queries beside it, and the fixtures' outputs with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mimo_tts.codec import attention, gemm, load_audio_tokenizer
from mimo_tts.codec.attention import Keys
from mimo_tts.codec.layers import Attention, sdpa
from mimo_tts.errors import UsageError
from mimo_tts.runtime.guards import thread_budget

pytestmark = pytest.mark.skipif(attention.library() is None,
                                reason=f"the kernel does not build here: {attention._build()[1]}")

# (batch, heads, queries, keys, head dim, Keys fields)
CASES = [
    (1, 4, 37, 37, 16, dict(causal=True, right=0)),
    (2, 3, 50, 50, 64, dict(lengths=torch.tensor([50, 23]))),
    (1, 2, 17, 60, 32, dict(offset=43, left=10, right=0)),
    (1, 20, 129, 129, 64, dict(causal=True, right=0)),
    (3, 2, 16, 16, 128, dict()),
    (1, 2, 21, 53, 80, dict(offset=32, right=0)),
]


def _qkv(batch, heads, queries, keys, dim, dtype, seed=0):
    """q, k, v [B, H, L, D] as views of one [B, L, H, 3 D] tensor (the layout a fused q/k/v
    projection leaves)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, max(queries, keys), heads, 3 * dim, generator=gen).to(dtype)
    q = x[:, :queries, :, :dim].transpose(1, 2)
    return q, x[:, :keys, :, dim:2 * dim].transpose(1, 2), x[:, :keys, :, 2 * dim:].transpose(1, 2)


def _reference(q, k, v, keys: Keys):
    """float64 softmax attention over the keys `keys` describes (independently of the kernel)."""
    _, _, lq, dim = q.shape
    i = torch.arange(lq)[:, None] + keys.offset
    j = torch.arange(k.shape[2])[None, :]
    seen = torch.ones(lq, k.shape[2], dtype=torch.bool)
    if keys.left >= 0:
        seen &= j >= i - keys.left
    if keys.right >= 0:
        seen &= j <= i + keys.right
    seen = seen[None, None]
    if keys.lengths is not None:
        seen = seen & (j < keys.lengths.view(-1, 1, 1, 1))
    scores = (q.double() @ k.double().transpose(-1, -2)) * dim ** -0.5
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v.double()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_equals_a_float64_softmax_over_the_keys_each_query_sees(case, dtype):
    *shape, fields = case
    q, k, v = _qkv(*shape, dtype)
    keys = Keys(**fields)
    got = attention.attend(q, k, v, keys)
    assert got.shape == q.shape and got.dtype == dtype
    want = _reference(q, k, v, keys)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    else:
        # A bfloat16 step of the exact value (the output's rounding), plus what rounding each
        # weight to bfloat16 may add where the CPU has the bfloat16 dot instruction (as
        # PyTorch's bfloat16 attention rounds them): 2^-9 of each weight, so at most 2^-9 of
        # the same attention over |v| (bounded here with 2^-8).
        step = want.abs().clamp_min(2.0 ** -8) * 2.0 ** -7 + \
            _reference(q, k, v.abs(), keys) * 2.0 ** -8
        assert ((got.double() - want).abs() <= step).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_bytes_at_every_thread_count(dtype):
    q, k, v = _qkv(2, 5, 45, 45, 64, dtype, seed=1)
    keys = Keys(causal=True, right=0)
    outs = []
    for threads in (1, 2, 3):
        with thread_budget(threads):
            outs.append(attention.attend(q, k, v, keys))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_batch_gives_each_sequence_its_bytes_alone(causal, dtype):
    lengths = [40, 17, 33]
    q, k, v = _qkv(3, 4, 40, 40, 32, dtype, seed=2)
    keys = Keys(causal=True, right=0) if causal else Keys(lengths=torch.tensor(lengths))
    batch = attention.attend(q, k, v, keys)
    for b, n in enumerate(lengths):
        alone = attention.attend(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                 Keys(causal=True, right=0) if causal else Keys())
        assert torch.equal(batch[b:b + 1, :, :n], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [20, 21])
def test_a_query_gets_its_bytes_whatever_queries_come_with_it(start, dtype):
    """Queries start..47 asked on their own (offset start) get what they get among all 48,
    though the kernel's blocks of rows (and, in bfloat16, its pairs of keys: odd windows)
    fall differently: the incremental decoder relies on it."""
    q, k, v = _qkv(1, 3, 48, 48, 64, dtype, seed=3)
    for fields in (dict(right=0), dict(left=9, right=0), dict(left=8, right=0)):
        whole = attention.attend(q, k, v, Keys(**fields))
        part = attention.attend(q[:, :, start:], k, v, Keys(offset=start, **fields))
        assert torch.equal(whole[:, :, start:], part)


def test_sdpa_takes_the_kernel_only_when_the_layer_asks():
    q, k, v = _qkv(1, 2, 24, 24, 16, torch.float32, seed=4)
    keys = Keys(causal=True, right=0)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(sdpa(q, k, v, keys), plain)
    assert torch.equal(sdpa(q, k, v, keys, fused=True), attention.attend(q, k, v, keys))
    few = q[:, :, :attention.MIN_QUERIES - 1]  # too few queries: PyTorch's
    assert torch.equal(sdpa(few, k, v, keys, fused=True),
                       F.scaled_dot_product_attention(few, k, v, is_causal=True))


def test_choose_follows_the_mode_and_the_kept_measurement(monkeypatch):
    assert not attention.choose(torch.float32, "off").active
    assert attention.choose(torch.float32, "on").active
    assert not attention.choose(torch.float16, "on").active
    with pytest.raises(UsageError):
        attention.choose(torch.float32, "fast")
    attention.faster.cache_clear()
    monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", "codec_attention=0")
    assert not attention.choose(torch.float32).active
    monkeypatch.setenv("MIMO_TTS_PRODUCT_CHOICES", "codec_attention=1")
    attention.faster.cache_clear()
    assert attention.choose(torch.bfloat16).active
    attention.faster.cache_clear()


@pytest.fixture(scope="module")
def codecs(tokenizer_dir):
    """The tiny-a tokenizer with the fused attention forced on and off (plain float32 linears
    in both, so only the attention differs)."""
    return {mode: load_audio_tokenizer(tokenizer_dir, "cpu", torch.float32, packing=gemm.PLAIN,
                                       codec_kernel=mode)
            for mode in ("on", "off")}


def test_prepack_sets_the_layers_choice(codecs):
    for mode, codec in codecs.items():
        layers = [m for m in codec.model.modules() if isinstance(m, Attention)]
        assert layers and all(m.fused is (mode == "on") for m in layers)


@pytest.mark.parametrize("frames", (37, 101))
def test_fixture_decode_matches_the_reference_with_the_kernel_on_and_off(codecs, decode_cases,
                                                                         frames):
    codes = decode_cases[f"decode_T{frames}.codes"]
    waves = {mode: codec.decode(codes) for mode, codec in codecs.items()}
    for wave in waves.values():
        torch.testing.assert_close(wave, decode_cases[f"decode_T{frames}.waveform"],
                                   atol=1e-4, rtol=0)
    assert not torch.equal(waves["on"], waves["off"])  # the kernel did run
    torch.testing.assert_close(waves["on"], waves["off"], atol=1e-5, rtol=0)


def test_fixture_encode_matches_the_reference_with_the_kernel_on(codecs, encode_cases):
    names = sorted(n.removesuffix(".waveform_in") for n in encode_cases
                   if n.endswith(".waveform_in"))
    assert names
    for name in names:
        hidden = codecs["on"].model.encoder(encode_cases[f"{name}.log_mel"])
        torch.testing.assert_close(hidden, encode_cases[f"{name}.encoder_hidden"], atol=1e-4,
                                   rtol=0)
        codes = codecs["on"].encode(encode_cases[f"{name}.waveform_in"], 24000)
        assert torch.equal(codes, encode_cases[f"{name}.codes_all"].long())


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernel built for AVX2 CPUs (8-float vectors, 16 registers), as the AVX2-only kind
    builds it natively; this CPU runs it where it has AVX2 and FMA."""
    import ctypes
    import shutil
    import subprocess

    from mimo_tts.runtime.devices import cpu_flags
    from mimo_tts.runtime.kernels import FLAGS

    if shutil.which("cc") is None or not {"avx2", "fma"} <= set(cpu_flags()):
        pytest.skip("needs cc and a CPU with AVX2 and FMA")
    target = tmp_path_factory.mktemp("avx2") / "attention.so"
    flags = [f if f != "-march=native" else "-march=haswell" for f in FLAGS]
    subprocess.run(["cc", *flags, str(attention.SOURCE), "-o", str(target), "-lm"], check=True,
                   capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(target))
    lib.attend.argtypes = attention.library().attend.argtypes
    lib.attend.restype = ctypes.c_int
    return lib


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c[:5]}")
def test_the_avx2_build_is_exact_and_the_same_at_every_thread_count(avx2_build, monkeypatch,
                                                                    case):
    monkeypatch.setattr(attention, "library", lambda: avx2_build)
    *shape, fields = case
    q, k, v = _qkv(*shape, torch.float32)
    keys = Keys(**fields)
    outs = []
    for threads in (1, 3):
        with thread_budget(threads):
            outs.append(attention.attend(q, k, v, keys))
    torch.testing.assert_close(outs[0].double(), _reference(q, k, v, keys), atol=2e-6, rtol=0)
    assert torch.equal(outs[0], outs[1])


def test_sdpa_keeps_pytorch_for_what_the_kernel_cannot_take():
    q, k, v = _qkv(1, 2, 24, 24, 16, torch.float32, seed=5)
    keys = Keys(causal=True, right=0)
    strided = torch.randn(1, 2, 24, 32)[..., ::2]  # rows not contiguous
    for args in ((q.half(), k.half(), v.half()), (strided, k, v), (q, k.double(), v)):
        assert not attention.runs(*args)
        with pytest.raises(ValueError):
            attention.attend(*args, keys)
    got = sdpa(strided, k, v, keys, fused=True)
    assert torch.equal(got, F.scaled_dot_product_attention(strided, k, v, is_causal=True))


def _windowed_stack(seed=6):
    """Two random layers of 4 heads of 16 (the full-size vocoder's head width) and their
    rotary tables."""
    from torch import nn

    from mimo_tts.codec.layers import Rotary, TransformerLayer

    torch.manual_seed(seed)
    layers = nn.ModuleList([TransformerLayer(64, 4, 128) for _ in range(2)]).eval()
    return layers.requires_grad_(False), Rotary(16, 10000.0)


@pytest.mark.parametrize("causal", [False, True])
def test_windowed_layers_match_pytorch_and_give_each_row_its_bytes_alone(causal):
    """The vocoder's banded attention (`LocalPlan`) through the kernel: within float32
    rounding of PyTorch's blockwise attention, and a padded batch gives each sequence exactly
    what it gets alone."""
    from mimo_tts.codec.layers import AttnSpec, run_layers

    layers, rotary = _windowed_stack()
    spec = AttnSpec(left=7, right=-1 if causal else 3, causal=causal)
    x = torch.randn(2, 150, 64)
    lengths = torch.tensor([150, 61])
    outs = {}
    for fused in (False, True):
        for layer in layers:
            layer.self_attn.fused = fused
        outs[fused] = run_layers(layers, rotary, x, spec, lengths)[0]
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(outs[True][b, :n], outs[False][b, :n], atol=2e-5, rtol=0)
        alone = run_layers(layers, rotary, x[b:b + 1, :n], spec)[0]
        assert torch.equal(outs[True][b:b + 1, :n], alone)
    assert not torch.equal(outs[True][0], outs[False][0])  # the kernel did run


def test_the_streaming_vocoders_band_takes_the_kernel_too():
    """The incremental vocoder runs its layers on a shared `attention_mask` (not a padded
    plan): with the kernel its rows match PyTorch's blockwise attention and the padded plan."""
    from mimo_tts.codec.layers import AttnSpec, attention_mask, run_layers

    layers, rotary = _windowed_stack(seed=7)
    spec, x = AttnSpec(left=40, right=10), torch.randn(1, 130, 64)
    rope = rotary.tables(130, x.device, x.dtype)
    keys = attention_mask(spec, 1, 130, None, x.device)
    assert isinstance(keys, Keys) and (keys.left, keys.right) == (40, 10)
    outs = {}
    for fused in (False, True):
        h = x
        for layer in layers:
            layer.self_attn.fused = fused
            h = layer(h, rope, spec, keys)
        outs[fused] = h
    torch.testing.assert_close(outs[True], outs[False], atol=2e-5, rtol=0)
    assert not torch.equal(outs[True], outs[False])
    torch.testing.assert_close(outs[True], run_layers(layers, rotary, x, spec)[0], atol=1e-6,
                               rtol=0)
