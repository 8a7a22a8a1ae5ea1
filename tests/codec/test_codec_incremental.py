"""Incremental streaming decode: exact pieces, chunking invariance, bounded state, distance."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec import StreamingDecoder
from mimo_tts.codec.incremental import DecoderCache, IncrementalDecoder, RunningNorm, VocoderStream
from mimo_tts.codec.layers import KV_ALIGN, AttnSpec, group_norm_fp32, run_layers
from mimo_tts.errors import UsageError

WAVE_TOL = 1e-4  # fixtures README §6
SAME_TOL = 1e-5  # one computation, different chunking: rounding only


def _stream(decoder, codes, chunk):
    """Push codes in chunks of `chunk`; (list of returned pieces, the joined waveform)."""
    pieces = []
    for start in range(0, codes.shape[1], chunk):
        pieces.append(decoder.push(codes[:, start:start + chunk],
                                   last=start + chunk >= codes.shape[1]))
    return pieces, torch.cat([p for p in pieces if p is not None])


def _chunks(total, sizes):
    """Split range(total) into consecutive pieces of the given sizes (cycled)."""
    out, start, index = [], 0, 0
    while start < total:
        out.append((start, min(total, start + sizes[index % len(sizes)])))
        start, index = out[-1][1], index + 1
    return out


@pytest.mark.parametrize("frames", [37, 101])
@pytest.mark.parametrize("chunk", [1, 7, 20])
def test_exact_when_the_state_covers_the_stream(codec, decode_cases, frames, chunk):
    """Context, statistics and warm-up spanning the stream: the reference one-shot waveform."""
    decoder = IncrementalDecoder(codec, context=frames, norm_window=frames, warmup=frames)
    _, wave = _stream(decoder, decode_cases[f"decode_T{frames}.codes"], chunk)
    assert wave.shape == (960 * frames,)
    torch.testing.assert_close(wave, decode_cases[f"decode_T{frames}.waveform"],
                               atol=WAVE_TOL, rtol=0)


def test_decoder_cache_equals_sliding_window_attention(codec):
    """The KV cache in uneven chunks equals one pass with a causal (window, 0) band."""
    decoder = codec.model.decoder
    x = torch.randn(1, 90, codec.config.d_model, generator=torch.Generator().manual_seed(0))
    for window in (90, 17):
        expected, _ = run_layers(decoder.layers, decoder.rotary, x,
                                 AttnSpec(window, -1, causal=True))
        cache = DecoderCache(decoder, window, slack=5)
        with torch.inference_mode():
            got = torch.cat([cache.step(x[:, a:b]) for a, b in _chunks(90, [1, 13, 4, 30])], 1)
        torch.testing.assert_close(got, expected, atol=SAME_TOL, rtol=0)
        assert cache.capacity < window + 30 + KV_ALIGN  # the largest chunk, aligned


def test_vocoder_stream_equals_one_shot_vocoder(codec):
    """Windowed vocoder layers, head and overlap-add are exact whatever the chunking."""
    vocoder = codec.model.decoder.vocoder
    features = torch.randn(1, 301, codec.config.n_mels, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = vocoder(features)[0]
        for sizes in ([301], [3], [13, 50, 7], [200, 101]):
            stream = VocoderStream(vocoder)
            pieces = [stream.push(features[:, a:b], final=b == 301)
                      for a, b in _chunks(301, sizes)]
            torch.testing.assert_close(torch.cat(pieces), expected, atol=SAME_TOL, rtol=0)
            assert max(stream.sizes()) <= stream.left + stream.right + max(sizes)


def test_running_norm_statistics_follow_the_window_rule(codec):
    norm = codec.model.decoder.dconv2.norm
    x = torch.randn(1, norm.num_channels, 60, generator=torch.Generator().manual_seed(2)) + 0.5
    full = RunningNorm(norm, window=60, warmup=60)
    torch.testing.assert_close(full.push(x, final=True), group_norm_fp32(norm, x),
                               atol=SAME_TOL, rtol=0)
    window, warmup = 9, 4
    running = RunningNorm(norm, window=window, warmup=warmup)
    got = torch.cat([running.push(x[..., a:b], final=b == 60)
                     for a, b in _chunks(60, [3, 1, 11])], dim=-1)
    for t in (0, 2, 3, 8, 9, 30, 59):  # frame t: statistics of frames [t-8, max(t, 3)]
        lo, hi = max(0, t - window + 1), max(t, warmup - 1)
        part = x[..., lo:hi + 1]
        mean, var = part.mean(), part.var(unbiased=False)
        expected = (x[..., t] - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias
        torch.testing.assert_close(got[..., t], expected, atol=SAME_TOL, rtol=0)
    assert running.sums.shape[0] == window - 1


def test_output_does_not_depend_on_chunk_boundaries(codec, decode_cases):
    codes = decode_cases["decode_T101.codes"]
    waves = [_stream(IncrementalDecoder(codec), codes, chunk)[1] for chunk in (101, 20, 7, 4)]
    for wave in waves:
        assert wave.shape == (960 * 101,)
        torch.testing.assert_close(wave, waves[0], atol=SAME_TOL, rtol=0)


def test_first_audio_comes_with_the_first_chunk(codec):
    """Audio lags the codes only by the vocoder's look-ahead plus the ISTFT overlap."""
    c = codec.config
    right = c.vocoder_attn_window_size[1]
    held = c.vocoder_num_layers * right * c.hop_length + (c.nfft - c.hop_length) // 2
    codes = torch.randint(0, 128, (8, 160), generator=torch.Generator().manual_seed(3))
    pieces, wave = _stream(IncrementalDecoder(codec), codes, 60)
    assert pieces[0] is not None and pieces[0].numel() == 960 * 60 - held
    assert pieces[1].numel() == 960 * 60 and wave.numel() == 960 * 160
    assert held < 960 * 41  # about the official right_overlap of 40 frames


def test_state_stays_bounded(codec):
    """Memory is flat in stream length: every cache is capped by the configured windows."""
    codes = torch.randint(0, 128, (8, 400), generator=torch.Generator().manual_seed(4))
    decoder = IncrementalDecoder(codec, context=20, norm_window=30, warmup=8)
    sizes = []
    for start in range(0, 400, 9):
        decoder.push(codes[:, start:start + 9])
        sizes.append((decoder.cache_sizes(), decoder.state_bytes()))
    third = len(sizes) // 3
    middle, last = sizes[third:2 * third], sizes[2 * third:]
    assert max(b for _, b in last) <= max(b for _, b in middle)  # flat, not growing
    limits = {key: max(s[key] for s, _ in sizes) for key in sizes[0][0]}
    assert limits["kv_latent_frames"] < 2 * 20 + 2 * 20 // 4 + 2 * 9 + KV_ALIGN
    assert limits["norm1_history"] < 2 * 30 and limits["norm2_history"] < 4 * 30
    assert limits["vocoder_inputs"] <= 40 + 10 + 4 * 9
    assert limits["overlap_add_samples"] < codec.config.nfft


def test_closer_to_one_shot_than_the_official_scheme(codec):
    """On tiny-a, a 24 s stream in 120-frame chunks: both distances to one-shot decode."""
    codes = torch.randint(0, 128, (8, 600), generator=torch.Generator().manual_seed(5))
    one_shot = codec.decode(codes)
    official = _stream(StreamingDecoder(codec), codes, 120)[1] - one_shot
    incremental = _stream(StreamingDecoder(codec, mode="incremental"), codes, 120)[1] - one_shot
    assert incremental.abs().max() <= official.abs().max()
    assert incremental.pow(2).mean() <= official.pow(2).mean()


def test_usage_errors(codec, decode_cases):
    with pytest.raises(UsageError, match="streaming mode"):
        StreamingDecoder(codec, mode="fast")
    with pytest.raises(UsageError, match="incremental"):
        StreamingDecoder(codec, context=10)
    with pytest.raises(UsageError, match="warmup"):
        IncrementalDecoder(codec, norm_window=10, warmup=20)
    stream = StreamingDecoder(codec, mode="incremental")
    stream.push(decode_cases["decode_T4.codes"], last=True)
    with pytest.raises(UsageError, match="reset"):
        stream.push(decode_cases["decode_T4.codes"])
    stream.reset()
    assert stream.push(decode_cases["decode_T4.codes"], last=True).numel() == 4 * 960


def _pushes(sizes, total):
    """Cut range(total) into pushes of `sizes` (the last size repeats)."""
    out, start = [], 0
    for size in sizes:
        if start >= total:
            break
        out.append((start, min(total, start + size)))
        start = out[-1][1]
    while start < total:
        out.append((start, min(total, start + sizes[-1])))
        start = out[-1][1]
    return out


@pytest.mark.parametrize("frames", [47, 180])
def test_growing_pushes_give_the_audio_of_fixed_pushes(codec, frames):
    """The growing schedule's pushes (look-ahead + 1 group, then 2, 4, 8 groups up to 10) give
    the audio of the old fixed pushes (5 groups, then 10) and of every other cut: the same
    samples to rounding (different pushes sum in a different order, ~1e-7 here, see
    docs/performance.md), and the same lengths at every push boundary they share."""
    codes = torch.randint(0, 128, (8, frames), generator=torch.Generator().manual_seed(7))
    group = 4
    schedules = {"growing": [11 * group, 2 * group, 4 * group, 8 * group, 10 * group],
                 "before": [5 * group, 10 * group], "fixed 5": [5 * group], "frames": [1],
                 "whole": [frames]}
    waves = {}
    for name, sizes in schedules.items():
        decoder = StreamingDecoder(codec, mode="incremental")
        pieces = [decoder.push(codes[:, a:b], last=b == frames) for a, b in _pushes(sizes, frames)]
        waves[name] = torch.cat([p for p in pieces if p is not None])
    for name, wave in waves.items():
        assert wave.shape == (960 * frames,), name
        torch.testing.assert_close(wave, waves["before"], atol=SAME_TOL, rtol=0)


@pytest.mark.parametrize("vocoder_layers", [2, 16])
def test_first_audio_frames_is_when_the_first_audio_comes(tmp_path, vocoder_layers):
    """`first_audio_frames` is the push on which the first audio leaves, frame by frame, in
    both modes: the norm warm-up (40) on the tiny presets' 2-layer vocoder, the vocoder's look-
    ahead plus the ISTFT overlap (41) with the published 16 layers."""
    from mimo_tts.codec import load_audio_tokenizer
    from mimo_tts.presets.codec import TINY_CODEC
    from mimo_tts.presets.write import write_random_checkpoint

    _, tok = write_random_checkpoint(tmp_path, codec_dims={**TINY_CODEC,
                                                           "vocoder_num_layers": vocoder_layers})
    codec = load_audio_tokenizer(tok, device="cpu", dtype=torch.float32)
    codes = torch.randint(0, 128, (8, 48), generator=torch.Generator().manual_seed(8))
    expected = {"incremental": 40 if vocoder_layers == 2 else 41, "official": 41}
    for mode, frames in expected.items():
        decoder = StreamingDecoder(codec, mode=mode)
        first = next(i + 1 for i in range(48) if decoder.push(codes[:, i:i + 1]) is not None)
        assert first == frames == StreamingDecoder(codec, mode=mode).first_audio_frames, mode
