"""Issue 13, root causes G (flag half) and M: option values past what the run can take are a
usage error (exit 2) up front, one line, nothing written; never a crash later in the run."""

from __future__ import annotations

import pytest

from mimo_tts.errors import EXIT_USAGE

BAD = [
    (["--seed", str(2**64)], "--seed must be in [0, 2**64 - 1]"),
    (["--temperature", "inf"], "temperature must be in [0, 100]"),
    (["--audio-temperature", "nan"], "audio_temperature must be in [0, 100]"),
    (["--sample-rate", "1000000"], "--sample-rate must be in [8000, 192000]"),
    (["--lm-threads", "100000"], "--lm-threads must be in [1, 256]"),
    (["--tokenizer-threads", "100000"], "--tokenizer-threads must be in [1, 256]"),
    (["--template", "10"], "--template must be in [0, 9]"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[a[0] for a, _ in BAD])
def test_out_of_range_option_is_a_usage_error(invoke, tmp_path, args, message):
    result = invoke("synth", "--model", "tiny", "--text", "Hello.", *args)
    assert result.exit_code == EXIT_USAGE, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("*.wav"))


def test_the_largest_seed_still_runs(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "Hello.", "--seed", str(2**64 - 1))
    assert result.exit_code == 0, result.stderr
    assert len(list(tmp_path.rglob("*.wav"))) == 1


@pytest.mark.parametrize("fmt", ["flac", "mp3", "wav-float"])
@pytest.mark.parametrize("dry", [(), ("--dry-run",)])
def test_b_raw_with_a_file_format_is_refused_not_ignored(invoke, fmt, dry):
    result = invoke("synth", "--model", "tiny", "--text", "Hi.", "--raw", "--format", fmt,
                    "--max-new-groups", "1", *dry)
    assert result.exit_code == EXIT_USAGE, result.stderr  # was: PCM on stdout, exit 0
    assert f"--raw streams 16-bit PCM without a header; --format {fmt} cannot be used" in \
        result.stderr
    assert result.stdout_bytes == b""
