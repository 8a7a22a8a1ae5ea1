"""Issue 32 item 20: prompt audio that was refused with nonsense. A FLAC of unknown length (its
STREAMINFO's total samples 0, as a stream encoder leaves it) is read by decoding it; a prompt
path that is a directory (or a FIFO) says so; a prompt past the documented length is refused
in one line before it is decoded whole."""

from __future__ import annotations

import os

import numpy as np
import pytest
import soundfile as sf
import torch

from mimo_tts.errors import EXIT_INPUT, InputError
from mimo_tts.synthesis.audio import (
    MAX_PROMPT_SECONDS,
    audio_seconds,
    check_prompt_file,
    read_audio,
)
from mimo_tts.synthesis.voices import source_record


def unknown_length(flac: bytes) -> bytes:
    """The same FLAC with STREAMINFO's 36-bit total-samples field zeroed (the FLAC format:
    "fLaC", a 4-byte block header, then bytes 13-17 of STREAMINFO end with that field)."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    data[8 + 13] &= 0xF0
    data[8 + 14:8 + 18] = bytes(4)
    return bytes(data)


@pytest.mark.parametrize("frames, channels", [(24000, 1), (150000, 2), (65536, 1)])
def test_a_flac_of_unknown_length_is_read_by_decoding_it(tmp_path, frames, channels):
    rng = np.random.default_rng(frames)
    samples = (0.2 * rng.standard_normal((frames, channels))).astype(np.float32)
    sf.write(tmp_path / "known.flac", samples, 24000)
    (tmp_path / "stream.flac").write_bytes(unknown_length((tmp_path / "known.flac").read_bytes()))
    assert sf.info(str(tmp_path / "stream.flac")).frames > 2**62  # libsndfile: "unknown"
    known, rate = read_audio(tmp_path / "known.flac")
    decoded, decoded_rate = read_audio(tmp_path / "stream.flac")  # before: "array is too big"
    assert torch.equal(decoded, known) and decoded_rate == rate == 24000
    assert audio_seconds(tmp_path / "stream.flac") == frames / 24000
    assert source_record(tmp_path / "stream.flac")["source"]["seconds"] == round(frames / 24000, 4)


def test_a_prompt_path_that_is_not_a_file_says_what_it_is(tmp_path):
    with pytest.raises(InputError, match=f"prompt audio {tmp_path} is a directory, not an audio "
                                         "file"):
        read_audio(tmp_path)  # before: "prompt audio not found"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        check_prompt_file(tmp_path / "fifo")
    with pytest.raises(InputError, match="prompt audio not found: "):
        read_audio(tmp_path / "absent.wav")
    with pytest.raises(InputError, match=r"the uploaded file upload:x.wav is a directory"):
        read_audio(tmp_path, "the uploaded file", shown="upload:x.wav")


def test_a_prompt_past_the_limit_is_refused_before_it_is_decoded(tmp_path):
    rate = 1000  # 601 s in 1.2 MB
    silence = np.zeros(((MAX_PROMPT_SECONDS + 1) * rate, 1), dtype=np.float32)
    sf.write(tmp_path / "long.flac", silence, rate)
    with pytest.raises(InputError, match=r"is 601 s long; a voice prompt may be at most 600 s"):
        read_audio(tmp_path / "long.flac")
    (tmp_path / "stream.flac").write_bytes(unknown_length((tmp_path / "long.flac").read_bytes()))
    with pytest.raises(InputError, match=r"is more than 6\d\d s long; a voice prompt may be at "
                                         r"most 600 s"):
        read_audio(tmp_path / "stream.flac")
    with pytest.raises(InputError, match=r"is more than 6\d s long; a voice prompt may be at "
                                         r"most 60 s"):
        audio_seconds(tmp_path / "stream.flac", max_seconds=60)


def test_an_unreadable_file_names_the_shown_name_not_the_path(tmp_path):
    (tmp_path / "upload").write_bytes(b"RIFF\x00\x00")
    with pytest.raises(InputError) as caught:
        read_audio(tmp_path / "upload", "the uploaded file", shown="upload:me.wav")
    assert str(tmp_path) not in str(caught.value)
    assert str(caught.value).startswith("the uploaded file upload:me.wav is unreadable or "
                                        "unsupported: ")


def test_a_corrupt_or_too_long_prompt_fails_its_item_before_the_models_load(invoke, tmp_path):
    """A voice prompt whose header does not decode (or past the length limit) fails its item
    before anything loads: no `load` in the summary (before: the models loaded first and the
    item failed when its prompt was built)."""
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x00\x00garbage")
    sf.write(tmp_path / "long.flac", np.zeros(((MAX_PROMPT_SECONDS + 1) * 1000, 1),
                                              dtype=np.float32), 1000)
    os.mkdir(tmp_path / "dir.wav")
    for name, words in (("bad.wav", "is unreadable or unsupported"),
                        ("long.flac", "is 601 s long"), ("dir.wav", "is a directory")):
        done = invoke("synth", "--model", "tiny", "--text", "Hi.", "--prompt-audio", name,
                      "-o", "x.wav")
        assert done.exit_code == EXIT_INPUT, done.stderr
        assert f"prompt audio {name} {words}" in done.stderr
        assert "| load" not in done.stderr and "loaded" not in done.stderr
    assert not (tmp_path / "x.wav").exists()
