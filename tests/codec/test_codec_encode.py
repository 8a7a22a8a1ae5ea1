"""Encode waveform -> log-mel -> codes against the reference fixtures (fixtures README §5.2)."""

from __future__ import annotations

import pytest
import torch
import torchaudio

from mimo_tts.codec.mel import prepare_audio
from mimo_tts.errors import InputError
from mimo_tts.lm.prompts import pad_prompt_codes

CASES = ("encode_chirp_1p3s", "encode_sines_2p7s")


@pytest.mark.parametrize("name", CASES)
def test_log_mel_matches_reference(codec, encode_cases, name):
    mel = codec.log_mel(encode_cases[f"{name}.waveform_in"])
    expected = encode_cases[f"{name}.log_mel"]
    assert mel.shape == expected.shape == (1 + encode_cases[f"{name}.waveform_in"].numel() // 240,
                                           codec.config.n_mels)
    torch.testing.assert_close(mel, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_encoder_hidden_matches_reference(codec, encode_cases, name):
    hidden = codec.model.encoder(encode_cases[f"{name}.log_mel"])
    torch.testing.assert_close(hidden, encode_cases[f"{name}.encoder_hidden"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_codes_match_reference_exactly(codec, encode_cases, name):
    audio = encode_cases[f"{name}.waveform_in"]
    codes = codec.encode(audio, 24000)
    assert codes.dtype == torch.int64
    assert torch.equal(codes, encode_cases[f"{name}.codes_all"].long())
    assert torch.equal(codes[:8], encode_cases[f"{name}.codes_8"].long())
    assert torch.equal(codec.encode_prompt(audio, 24000), codes)  # plain: the LM pads
    prompt = pad_prompt_codes(codec.encode_prompt(audio, 24000), 8)  # as the LM takes it
    assert torch.equal(prompt, encode_cases[f"{name}.codes_group_padded"].long())
    assert prompt.shape[1] % 4 == 0
    flat = prompt.t().reshape(-1)  # frame-major, as the prompt builder consumes it
    assert torch.equal(flat, encode_cases[f"{name}.codes_group_padded_flat"].long())


def test_prompt_padding_repeats_last_frame(codec, encode_cases):
    codes = codec.encode_prompt(encode_cases["encode_chirp_1p3s.waveform_in"], 24000)
    prompt = pad_prompt_codes(codes, 8)
    assert prompt.shape == (8, 36)  # 33 frames -> 36
    assert torch.equal(prompt[:, 33:], prompt[:, 32:33].expand(-1, 3))


def test_mixdown_happens_before_resampling():
    stereo = torch.randn(2, 4800, generator=torch.Generator().manual_seed(0))
    expected = torchaudio.functional.resample(stereo.mean(0), 48000, 24000)
    assert torch.equal(prepare_audio(stereo, 48000, 24000), expected)
    assert torch.equal(prepare_audio(stereo, 24000, 24000), stereo.mean(0))


def test_channel_layouts_give_the_same_codes(codec, encode_cases):
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]
    expected = encode_cases["encode_chirp_1p3s.codes_all"].long()
    assert torch.equal(codec.encode(audio[None], 24000), expected)
    assert torch.equal(codec.encode(torch.stack([audio, audio]), 24000), expected)


def test_stereo_48k_gives_right_shape_and_near_codes(codec, encode_cases):
    audio = encode_cases["encode_chirp_1p3s.waveform_in"]
    up = torchaudio.functional.resample(audio, 24000, 48000)
    stereo = torch.stack([0.8 * up, 1.2 * up])  # the mix-down restores the original level
    codes = codec.encode(stereo, 48000)
    expected = encode_cases["encode_chirp_1p3s.codes_all"].long()
    assert codes.shape == expected.shape == (20, 33)
    agreement = (codes[0] == expected[0]).float().mean().item()
    assert agreement >= 0.75, agreement


@pytest.mark.parametrize(
    ("audio", "rate", "needle"),
    [
        (torch.zeros(100, dtype=torch.int16), 24000, "floating point"),
        (torch.zeros(0), 24000, "[samples]"),
        (torch.zeros(1, 2, 3), 24000, "[samples]"),
        (torch.zeros(4800, 2), 24000, "channels first"),
        (torch.full((4800,), float("nan")), 24000, "NaN"),
        (torch.zeros(4800), 0, "sample_rate"),
    ],
)
def test_bad_audio_raises_input_error(codec, audio, rate, needle):
    with pytest.raises(InputError) as info:
        codec.encode(audio, rate)
    assert needle in str(info.value)


def test_long_audio_is_encoded_in_independent_60s_segments(codec):
    """Spec §3.3: 60.0 s -> 6001 mel frames -> segments of 6000 + 1 -> 1500 + 1 code frames."""
    audio = 0.1 * torch.randn(60 * 24000, generator=torch.Generator().manual_seed(2))
    codes = codec.encode(audio, 24000)
    assert codes.shape == (20, 1501)
    mel = codec.log_mel(audio)
    assert mel.shape[0] == 6001
    first = codec.model.encoder.quantizer.encode(codec.model.encoder(mel[:6000]))
    assert torch.equal(codes[:, :1500], first)
