"""mimo_tts.synthesis.options: one resolution pass (flag > env > profile > default), typed
option groups that validate themselves, and the profiles shipped as package data."""

from __future__ import annotations

import tomllib

import pytest

from mimo_tts.errors import UsageError
from mimo_tts.runtime.devices import Probe
from mimo_tts.synthesis import options as mopts
from mimo_tts.synthesis import settings as msettings
from mimo_tts.synthesis.options import EngineOptions, RunOptions, SynthesisOptions
from mimo_tts.synthesis.profiles import PROFILE_DIR, USER_PROFILE_ENV, load_profile
from mimo_tts.synthesis.settings import resolve

CONFIGS = PROFILE_DIR  # the top-level configs/, installed as mimo_tts.configs
NO_GPU = Probe(cuda_count=0, cuda_current=0, mps=False)


def test_flag_beats_profile_beats_default_with_is_not_none():
    profile = {"seed": 5, "temperature": 0.9, "save_codes": True, "max_chars": 100}
    s = resolve({"seed": 0, "temperature": 0.0, "save_codes": False}, profile, env={})
    assert (s.synthesis.seed, s.synthesis.temperature, s.run.save_codes) == (0, 0.0, False)
    assert s.synthesis.max_chars == 100  # from the profile
    assert s.run.format == "wav" and s.run.batch_size == 1  # defaults
    assert (s.sources["seed"], s.sources["max_chars"], s.sources["format"]) == (
        "flag", "config", "default")


def test_env_sits_between_flag_and_profile_for_devices_and_checkpoints(tmp_path):
    """Devices and checkpoints resolve in the same pass, with their env variables."""
    profile = {"tokenizer_device": "cpu", "lm_device": "cpu", "model": "tiny",
               "cuda_graph": False}
    s = resolve({}, profile, env={"MIMO_TTS_LM_DEVICE": "cpu"}, probe=NO_GPU)
    assert s.placement.lm_device.source == "env MIMO_TTS_LM_DEVICE"
    assert s.placement.tokenizer_device.source == "config"
    assert s.checkpoints.lm == ("tiny", "config") and s.checkpoints.tokenizer[0] == "tiny"
    tok = tmp_path / "tok"
    tok.mkdir()
    s = resolve({"model": "x/y"}, profile, env={"MIMO_AUDIO_TOKENIZER_PATH": str(tok)},
                probe=NO_GPU)
    assert s.checkpoints.lm == ("x/y", "flag")
    assert s.checkpoints.tokenizer == (str(tok), "env MIMO_AUDIO_TOKENIZER_PATH")
    assert s.sources["tokenizer"] == "env MIMO_AUDIO_TOKENIZER_PATH"


@pytest.mark.parametrize("cls, change, match", [
    (RunOptions, {"format": "aiff"}, "--format"), (RunOptions, {"batch_size": 0}, "--batch-size"),
    (SynthesisOptions, {"top_p": 1.5}, "top_p"),
    (SynthesisOptions, {"temperature": -1}, "temperature"),
    (RunOptions, {"sample_rate": 100}, "--sample-rate"),
    (SynthesisOptions, {"max_new_groups": 0}, "--max-new-groups"),
    (SynthesisOptions, {"task": "nope"}, "unknown --task"),
    (SynthesisOptions, {"instruct": "calm"}, "takes no instruction"),
    (EngineOptions, {"max_num_seqs": 4}, "applies to --engine vllm only"),
    (EngineOptions, {"lm_threads": 0}, "--lm-threads"),
])
def test_each_group_validates_itself(cls, change, match):
    with pytest.raises(UsageError, match=match):
        cls(**change)


@pytest.mark.parametrize("values, match", [
    ({"raw": True, "output": "x.wav"}, "--raw writes"),
    ({"stream": True, "batch_size": 2}, "--stream"),
    ({"raw": True, "sample_rate": 16000}, "--raw streams"),
])
def test_combinations_are_checked_once_every_value_is_valid(values, match):
    with pytest.raises(UsageError, match=match):
        resolve(values, env={}, probe=NO_GPU)
    with pytest.raises(UsageError, match="top_p"):  # a bad value is reported first
        resolve({**values, "top_p": 3.0}, env={}, probe=NO_GPU)


def test_generation_options_come_from_the_task_spec():
    from mimo_tts.lm.tasks import TASKS

    o = SynthesisOptions(task="tts_sft_with_instruct", instruct="calm", audio_top_p=0.5)
    gen = o.generation_options(seed=3)
    text, audio = TASKS[o.task].samplers()
    assert gen.text_sampler == text and gen.audio_sampler.top_p == 0.5
    assert gen.audio_sampler.temperature == audio.temperature
    assert gen.stop_tokens == TASKS[o.task].stop_tokens and gen.seed == 3


def test_replace_revalidates_the_group():
    s = resolve({}, env={}, probe=NO_GPU)
    assert s.replace(batch_size=2).run.batch_size == 2
    with pytest.raises(UsageError, match="--batch-size"):
        s.replace(batch_size=0)


def test_builtin_profiles_are_package_data_and_use_option_names():
    names = sorted(p.stem for p in CONFIGS.glob("*.toml"))
    assert names == ["ci-smoke", "cpu-tokenizer", "default"]
    for name in names:
        profile = load_profile(name, env={})
        assert profile == tomllib.loads((CONFIGS / f"{name}.toml").read_text())
        assert set(profile) <= msettings.PROFILE_KEYS
    cpu_tok = load_profile(str(CONFIGS / "cpu-tokenizer.toml"))
    assert (cpu_tok["lm_device"], cpu_tok["tokenizer_device"], cpu_tok["cuda_graph"]) == (
        "cuda:0", "cpu", False)
    smoke = load_profile("ci-smoke", env={})
    assert (smoke["model"], smoke["lm_device"], smoke["tokenizer_device"]) == ("tiny", "cpu",
                                                                              "cpu")
    resolve({}, smoke, env={}, probe=NO_GPU)  # every value validates


def test_user_profile_folder_comes_first(tmp_path):
    (tmp_path / "ci-smoke.toml").write_text("seed = 9\n")
    (tmp_path / "mine.toml").write_text("max_chars = 50\n")
    env = {USER_PROFILE_ENV: str(tmp_path)}
    assert load_profile("ci-smoke", env=env) == {"seed": 9}
    assert load_profile("mine", env=env) == {"max_chars": 50}
    with pytest.raises(UsageError, match="not found: mine"):
        load_profile("mine", env={USER_PROFILE_ENV: str(tmp_path / "none")})


def test_profile_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("seeed = 1\n")
    with pytest.raises(UsageError, match="unknown key.*seeed"):
        load_profile(str(bad))
    bad.write_text("seed = \n")
    with pytest.raises(UsageError, match="invalid TOML"):
        load_profile(str(bad))
    with pytest.raises(UsageError, match="bad option value|must"):
        resolve({}, {"seed": -3}, env={}, probe=NO_GPU)


def test_option_values_name_every_option_once_with_its_type():
    """`OptionValues` (what a command builds from its flags) has one field per option: each
    group's fields, the placement's and the checkpoints', each of that field's value type."""
    from dataclasses import fields
    from typing import get_args, get_type_hints

    def value_type(hint):
        return next(t for t in get_args(hint) or (hint,) if t is not type(None))

    expected = {f.name: value_type(get_type_hints(cls)[f.name])
                for cls in msettings.GROUPS.values() for f in fields(cls)}
    expected.update({name: str for name in mopts.PLACEMENT_FIELDS}, cuda_graph=bool,
                    model=str, tokenizer=str, allow_download=bool)
    assert msettings.PROFILE_TYPES == expected
    assert all(f.default is None for f in fields(msettings.OptionValues))


def test_resolve_takes_option_values_or_a_mapping_of_option_names():
    given = msettings.OptionValues(seed=4, lm_device="cpu", tokenizer_device="cpu", model="tiny")
    typed = resolve(given, env={}, probe=NO_GPU)
    assert typed == resolve(given.given(), env={}, probe=NO_GPU)
    assert (typed.synthesis.seed, typed.checkpoints.lm) == (4, ("tiny", "flag"))
    with pytest.raises(UsageError, match="unknown option.*'sede'"):
        resolve({"sede": 4}, env={}, probe=NO_GPU)
