"""Issue 13 item 9 and root cause F: every profile value is checked against its option's type
and range (the flags' bounds) before anything runs: one `Error:` line naming the profile file,
the key and what it must be, exit 2; an unknown key is named with the closest known key."""

from __future__ import annotations

import pytest

from mimo_tts.errors import EXIT_USAGE, UsageError
from mimo_tts.synthesis import settings as msettings
from mimo_tts.synthesis.profiles import load_profile

WRONG_TYPES = [
    ('overwrite = "no"', "overwrite must be true or false, got a string 'no'"),
    ('seed = "x"', "seed must be an integer, got a string 'x'"),
    ("seed = 1.5", "seed must be an integer, got a float 1.5"),
    ("seed = true", "seed must be an integer, got a boolean True"),
    ("seed = 1979-05-27", "seed must be an integer, got a date"),
    ('temperature = "hot"', "temperature must be a number, got a string 'hot'"),
    ("max_chars = [1, 2]", "max_chars must be an integer, got an array"),
    ("lm_device = 0", "lm_device must be a string, got an integer 0"),
    ('cuda_graph = "yes"', "cuda_graph must be true or false, got a string 'yes'"),
    ("model = { name = 'tiny' }", "model must be a string, got a table"),
    ("format = 3", "format must be a string, got an integer 3"),
]
OUT_OF_RANGE = [
    ("seed = -1", "seed = -1: --seed must be in [0, 2**64 - 1]"),
    ("temperature = nan", "temperature = nan: temperature must be in [0, 100]"),
    ("audio_top_p = 2.0", "audio_top_p = 2.0: audio_top_p must be in (0, 1]"),
    ("sample_rate = 1000000", "sample_rate = 1000000: --sample-rate must be in [8000, 192000]"),
    ("lm_threads = 100000", "lm_threads = 100000: --lm-threads must be in [1, 256]"),
    ('task = "bogus"', "task = 'bogus': unknown --task 'bogus'"),
    ("max_num_seqs = 4", "max_num_seqs = 4: --max-num-seqs applies to --engine vllm only"),
]


@pytest.mark.parametrize(("line", "message"), WRONG_TYPES + OUT_OF_RANGE,
                         ids=[line for line, _ in WRONG_TYPES + OUT_OF_RANGE])
def test_bad_profile_value_is_one_line_naming_file_and_key(invoke, tmp_path, line, message):
    profile = tmp_path / "bad.toml"
    profile.write_text(line + "\n", encoding="utf-8")
    result = invoke("synth", "--model", "tiny", "--config", str(profile), "--text", "Hello.")
    assert result.exit_code == EXIT_USAGE, result.output
    (error,) = result.stderr.splitlines()
    assert error == f"Error: {profile}: {message}" or (
        error.startswith(f"Error: {profile}: ") and message in error), error
    assert not list(tmp_path.rglob("*.wav"))


def test_a_profile_value_that_fits_with_the_flags_is_kept(tmp_path):
    profile = tmp_path / "vllm.toml"
    profile.write_text("max_num_seqs = 4\ntemperature = 1\n", encoding="utf-8")
    loaded = load_profile(str(profile))
    settings = msettings.resolve_options({"engine": "vllm"}, loaded)
    assert settings.engine.max_num_seqs == 4 and settings.synthesis.temperature == 1
    with pytest.raises(UsageError, match=r"--seed must be in"):  # a flag's error stays its own
        msettings.resolve_options({"seed": -1}, loaded | {"max_chars": 10})


def test_unknown_profile_keys_are_named_with_a_suggestion(tmp_path):
    profile = tmp_path / "typo.toml"
    profile.write_text("sed = 1\ntokenizer_devices = 'cpu'\nzzz = 0\n", encoding="utf-8")
    with pytest.raises(UsageError) as caught:
        load_profile(str(profile))
    assert str(caught.value) == (f"{profile}: unknown key(s) sed (did you mean seed?), "
                                 "tokenizer_devices (did you mean tokenizer_device?), zzz")
