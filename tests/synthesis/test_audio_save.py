"""`Audio.save`: every format the CLI writes, byte for byte the CLI's file for the same text and
seed, written atomically; bad names are the CLI's usage errors."""

from __future__ import annotations

import os

import pytest

from mimo_tts.errors import OutputError, UsageError
from mimo_tts.presets import ensure_tiny_preset
from mimo_tts.runtime.paths import CACHE_ENV, TEMP_MARK
from mimo_tts.synthesis import aac
from mimo_tts.synthesis.audio import AAC_FORMATS, FORMATS, LOSSY_FORMATS, lossy_formats

TEXT = "Saved from the library. Then a second sentence."
SEED = 7
# every format `synth --format` takes that this libsndfile can write; wav-float needs --format
# (aac and m4a where PyAV is installed)
WRITTEN = [f for f in FORMATS if (f not in LOSSY_FORMATS or f in lossy_formats())
           and (f not in AAC_FORMATS or aac.available())]


@pytest.fixture(scope="module")
def tts(tiny_cache):
    import mimo_tts

    lm, tok = ensure_tiny_preset({CACHE_ENV: str(tiny_cache)})
    return mimo_tts.load(str(lm), str(tok), lm_device="cpu", tokenizer_device="cpu")


@pytest.fixture(scope="module")
def audio(tts):
    return tts.synthesize(TEXT, seed=SEED, max_chars=30)


@pytest.mark.parametrize("fmt", WRITTEN)
def test_save_equals_the_cli_file_byte_for_byte(fmt, tts, audio, invoke, tmp_path):
    ext = FORMATS[fmt][2]
    given = ["--format", fmt] if fmt == "wav-float" else []
    result = invoke("synth", "--model", str(tts.lm_ref.path), "--tokenizer",
                    str(tts.tok_ref.path), "--lm-device", "cpu", "--tokenizer-device", "cpu",
                    "--text", TEXT, "--seed", SEED, "--max-chars", 30, "-o", f"cli{ext}",
                    *given)
    assert result.exit_code == 0, result.stderr
    saved = audio.save(tmp_path / f"lib{ext}", format=fmt if given else None)
    assert saved == tmp_path / f"lib{ext}"
    assert saved.read_bytes() == (tmp_path / f"cli{ext}").read_bytes()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(TEMP_MARK)]


def test_save_replaces_a_file_whole_and_takes_os_paths(audio, tmp_path):
    target = tmp_path / "out.flac"
    target.write_bytes(b"old")
    assert audio.save(str(target)) == target
    assert target.read_bytes()[:4] == b"fLaC"


@pytest.mark.parametrize(("name", "fmt", "words"), [
    ("speech.xyz", None, "cannot tell the audio format"),
    ("speech.wav", "flac", "disagrees with the file name"),
    ("speech.wav", "aiff", "--format must be one of"),
])
def test_save_refuses_names_and_formats_as_the_cli_does(audio, tmp_path, name, fmt, words):
    with pytest.raises(UsageError, match=words):
        audio.save(tmp_path / name, format=fmt)
    assert not (tmp_path / name).exists()


def test_save_into_a_missing_folder_is_an_output_error(audio, tmp_path):
    with pytest.raises(OutputError, match="cannot write"):
        audio.save(tmp_path / "missing" / "speech.wav")


@pytest.mark.parametrize("fmt", [f for f in ("opus", "ogg") if f in WRITTEN])
def test_ogg_files_have_one_serial_and_valid_page_checksums(fmt):
    """libsndfile's serial is random: the package fixes it, and each page's CRC matches the
    one libogg computes (checked on libsndfile's own first page)."""
    import io

    import numpy as np
    import soundfile as sf

    from mimo_tts.synthesis.audio import OGG_SERIAL, _ogg_crc, encode_audio

    samples = (0.3 * np.sin(np.arange(24000) / 7)).astype(np.float32)
    first, second = encode_audio(samples, 24000, fmt), encode_audio(samples, 24000, fmt)
    assert first == second and first[14:18] == OGG_SERIAL.to_bytes(4, "little")
    assert sf.read(io.BytesIO(first))[0].shape == (24000,)
    raw = io.BytesIO()
    container, subtype, *_ = FORMATS[fmt]
    sf.write(raw, samples, 24000, format=container, subtype=subtype)
    page = bytearray(raw.getvalue())
    end = 27 + page[26] + sum(page[27:27 + page[26]])
    stored, page[22:26] = bytes(page[22:26]), bytes(4)
    assert _ogg_crc(page[:end]).to_bytes(4, "little") == stored


AAC_ENCODE = """
import hashlib, sys
import numpy as np
from mimo_tts.synthesis.audio import encode_audio
samples = (0.3 * np.sin(np.arange(48000) / 7)).astype(np.float32)
print(hashlib.sha256(encode_audio(samples, 24000, sys.argv[1])).hexdigest())
"""


@pytest.mark.parametrize("fmt", AAC_FORMATS)
def test_aac_files_are_byte_stable_and_read_back(fmt, tmp_path):
    """aac (ADTS) and m4a (MP4) through PyAV: the same samples give the same bytes in two
    processes (no version string, no creation time), and the file decodes to their length."""
    import io
    import subprocess
    import sys

    import numpy as np

    av = pytest.importorskip("av")
    from mimo_tts.synthesis.audio import encode_audio

    digests = {subprocess.run([sys.executable, "-c", AAC_ENCODE, fmt], capture_output=True,
                              text=True, check=True).stdout for _ in range(2)}
    assert len(digests) == 1
    samples = (0.3 * np.sin(np.arange(48000) / 7)).astype(np.float32)
    data = encode_audio(samples, 24000, fmt)
    assert b"Lavc" not in data and b"Lavf" not in data
    assert data[:2] == b"\xff\xf1" if fmt == "aac" else data[4:8] == b"ftyp"
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate) == ("aac", 24000)
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
    assert abs(len(decoded) - len(samples)) <= 2 * 1024  # the encoder's priming and padding


def test_aac_without_pyav_is_a_one_line_usage_error(audio, invoke, tmp_path, monkeypatch):
    """Without PyAV, aac and m4a are refused before anything loads (exit 2, as for the other
    missing extras), on the CLI and in `Audio.save`."""
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # `import av` fails, as when not installed
    for fmt in AAC_FORMATS:
        result = invoke("synth", "--model", "tiny", "--text", "x", "-o", f"x.{fmt}")
        assert result.exit_code == 2 and not (tmp_path / f"x.{fmt}").exists()
        (line,) = result.stderr.splitlines()
        assert line == f"Error: --format {fmt} needs PyAV: {aac.EXTRA}"
        with pytest.raises(UsageError, match="needs PyAV"):
            audio.save(tmp_path / f"lib.{fmt}")


def test_float_wav_bytes_do_not_follow_the_clock():
    """libsndfile stamps a float WAV's PEAK chunk with the second it was written: the package
    zeroes the stamp (the same samples written a second apart are the same bytes; CI once saw
    `decode` differ from `synth` by that one field) and keeps the chunk's peak and its place."""
    import io
    import struct

    import numpy as np
    import soundfile as sf

    from mimo_tts.synthesis.audio import encode_audio

    samples = (0.3 * np.sin(np.arange(24000) / 7)).astype(np.float32)
    samples[1234] = -0.75
    raw = io.BytesIO()
    sf.write(raw, samples, 24000, format="WAV", subtype="FLOAT")
    theirs, ours = raw.getvalue(), encode_audio(samples, 24000, "wav-float")
    at = ours.index(b"PEAK")
    assert theirs.index(b"PEAK") == at and len(theirs) == len(ours)
    version, stamp, peak, where = struct.unpack("<IIfI", ours[at + 8:at + 24])
    assert struct.unpack("<I", theirs[at + 12:at + 16])[0] > 0  # libsndfile's own: the time
    assert (version, stamp, peak, where) == (1, 0, 0.75, 1234)
    assert ours[:at + 12] == theirs[:at + 12] and ours[at + 16:] == theirs[at + 16:]
    np.testing.assert_array_equal(sf.read(io.BytesIO(ours), dtype="float32")[0], samples)
