"""Decode codes -> waveform against the reference fixtures (fixtures README §5.1, §6)."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.codec.cudagraph import GraphDecoder
from mimo_tts.errors import AudioCheckError, InputError

WAVE_TOL = 1e-4
VQ_TOL = 1e-6
FRAMES = (4, 37, 101)


@pytest.mark.parametrize("frames", FRAMES)
def test_dequantize_matches_vq_hidden(codec, decode_cases, frames):
    codes = decode_cases[f"decode_T{frames}.codes"]
    hidden = codec.dequantize(codes)
    assert hidden.dtype == torch.float32
    torch.testing.assert_close(hidden, decode_cases[f"decode_T{frames}.vq_hidden"],
                               atol=VQ_TOL, rtol=0)


@pytest.mark.parametrize("frames", FRAMES)
def test_decode_matches_reference_waveform(codec, decode_cases, frames):
    wave = codec.decode(decode_cases[f"decode_T{frames}.codes"])
    assert wave.dtype == torch.float32 and wave.device == codec.device
    assert wave.shape == (codec.config.samples_per_frame * frames,) == (960 * frames,)
    torch.testing.assert_close(wave, decode_cases[f"decode_T{frames}.waveform"],
                               atol=WAVE_TOL, rtol=0)


def test_decode_batch_equals_single_decode(codec, decode_cases):
    items = [decode_cases[f"decode_T{t}.codes"] for t in (37, 4, 101)]
    items.append(items[0][:, :5])
    waves = codec.decode_batch(items)
    assert len(waves) == len(items)
    for codes, wave in zip(items, waves, strict=True):
        alone = codec.decode(codes)
        assert wave.shape == alone.shape
        torch.testing.assert_close(wave, alone, atol=1e-6, rtol=0)


def test_bucket_padding_is_exact(codec, decode_cases):
    """The CUDA-graph computation (zero-pad to a bucket + masks) equals unpadded decode."""
    graphs = GraphDecoder(codec.model.decoder, codec.device)
    for frames in (5, 37, 101):  # buckets 6, 64, 128: heavy padding
        codes = decode_cases["decode_T101.codes"][:, :frames]
        padded = graphs.padded_eager(codec.dequantize(codes))
        torch.testing.assert_close(padded, codec.decode(codes), atol=1e-6, rtol=0)
    assert graphs.bucket_for(37) == 64 and not graphs.supports(257)


def test_decode_chunks_independently_every_1500_frames(codec):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 128, (8, 1502), generator=generator)
    wave = codec.decode(codes)
    assert wave.shape == (1502 * 960,)
    tail = codec.decode(codes[:, 1500:])
    torch.testing.assert_close(wave[1500 * 960:], tail, atol=1e-6, rtol=0)


def test_decode_accepts_up_to_all_codebooks(codec, decode_cases):
    codes = decode_cases["decode_T4.codes"].long()
    extra = torch.zeros(12, 4, dtype=torch.long)
    wave20 = codec.decode(torch.cat([codes, extra]))
    assert wave20.shape == (3840,)
    hidden20 = codec.dequantize(torch.cat([codes, extra]))
    embeds = [layer._codebook.embed[0] for layer in codec.model.encoder.quantizer.vq.layers[8:]]
    expected = codec.dequantize(codes) + torch.stack(embeds).sum(0)
    torch.testing.assert_close(hidden20, expected, atol=1e-5, rtol=0)


def test_decode_empty_codes_gives_no_samples(codec):
    assert codec.decode(torch.zeros(8, 0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize(
    ("codes", "error", "needle"),
    [
        (torch.zeros(8, 4), InputError, "integer dtype"),
        (torch.zeros(8, dtype=torch.long), InputError, "[K, T]"),
        (torch.zeros(21, 4, dtype=torch.long), InputError, "K <= 20"),
        (torch.tensor([[0, 1024]] + [[0, 0]] * 7), AudioCheckError, "code 1024 at codebook 0"),
        (torch.tensor([[0, 0]] * 2 + [[0, 128]] + [[0, 0]] * 5), AudioCheckError, "codebook 2"),
        (torch.tensor([[0, 0]] * 7 + [[-1, 0]]), AudioCheckError, "code -1"),
    ],
)
def test_invalid_codes_raise_clear_errors(codec, codes, error, needle):
    with pytest.raises(error, match=None) as info:
        codec.decode(codes)
    assert needle in str(info.value)
