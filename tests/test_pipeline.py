"""mimo_tts.options (options, profiles), mimo_tts.results (exit codes, audio checks) and
mimo_tts.pipeline (resume keys, Stage-0/Stage-1 glue)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from mimo_tts import options as mopts
from mimo_tts import pipeline, results
from mimo_tts.errors import (
    EXIT_INPUT,
    EXIT_NO_AUDIO,
    EXIT_OK,
    EXIT_PARTIAL,
    AudioCheckError,
    NoAudioError,
    UsageError,
)
from mimo_tts.inputs import Item
from mimo_tts.options import SynthOptions, build_options
from mimo_tts.results import ItemResult, exit_code_for

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# --- options and profiles -----------------------------------------------------------------------


def test_flag_beats_profile_beats_default_with_is_not_none():
    profile = {"seed": 5, "temperature": 0.9, "save_codes": True, "max_chars": 100}
    options = build_options({"seed": 0, "temperature": 0.0, "save_codes": False}, profile)
    assert (options.seed, options.temperature, options.save_codes) == (0, 0.0, False)
    assert options.max_chars == 100  # from the profile
    assert options.format == "wav" and options.batch_size == 1  # defaults


def test_env_resolved_fields_are_not_merged_from_the_profile():
    """Devices and checkpoints: the profile goes to devices.py/models.py, after the env."""
    options = build_options({}, {"tokenizer_device": "cpu", "model": "tiny", "cuda_graph": False})
    assert options.tokenizer_device is None and options.model is None
    assert options.cuda_graph is None


@pytest.mark.parametrize("change, match", [
    ({"format": "mp3"}, "--format"), ({"batch_size": 0}, "--batch-size"),
    ({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature"),
    ({"sample_rate": 100}, "--sample-rate"), ({"raw": True, "output": "x.wav"}, "--raw"),
    ({"max_new_groups": 0}, "--max-new-groups"),
])
def test_validation(change, match):
    with pytest.raises(UsageError, match=match):
        SynthOptions(**change).validate()


def test_profiles_in_configs_load_and_use_option_names():
    names = sorted(p.stem for p in CONFIGS.glob("*.toml"))
    assert names == ["ci-smoke", "cpu-tokenizer", "default"]
    for name in names:
        profile = mopts.load_profile(name)
        assert profile == tomllib.loads((CONFIGS / f"{name}.toml").read_text())
        build_options({}, profile)  # every value validates
    cpu_tok = mopts.load_profile(str(CONFIGS / "cpu-tokenizer.toml"))
    assert (cpu_tok["lm_device"], cpu_tok["tokenizer_device"], cpu_tok["cuda_graph"]) == (
        "cuda:0", "cpu", False)
    smoke = mopts.load_profile("ci-smoke")
    assert (smoke["model"], smoke["lm_device"], smoke["tokenizer_device"]) == ("tiny", "cpu",
                                                                              "cpu")


def test_profile_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("seeed = 1\n")
    with pytest.raises(UsageError, match="unknown key.*seeed"):
        mopts.load_profile(str(bad))
    bad.write_text("seed = \n")
    with pytest.raises(UsageError, match="invalid TOML"):
        mopts.load_profile(str(bad))
    with pytest.raises(UsageError, match="bad option value|must"):
        build_options({}, {"seed": -3})


# --- exit codes ---------------------------------------------------------------------------------


def _result(status, code=EXIT_OK):
    return ItemResult(item=Item(id="x", text="t", source="s"), status=status, exit_code=code)


def test_exit_code_rules():
    assert exit_code_for([_result("ok"), _result("skipped")]) == EXIT_OK
    assert exit_code_for([_result("error", EXIT_NO_AUDIO)]) == EXIT_NO_AUDIO
    assert exit_code_for([_result("error", EXIT_INPUT)] * 2) == EXIT_INPUT
    assert exit_code_for([_result("ok"), _result("error", EXIT_NO_AUDIO)]) == EXIT_PARTIAL
    mixed = [_result("error", EXIT_NO_AUDIO), _result("error", EXIT_INPUT)]
    assert exit_code_for(mixed) == EXIT_PARTIAL


# --- checks and joins ---------------------------------------------------------------------------


def test_check_audio():
    results.check_audio(torch.tensor([0.0, 0.2]), "a")
    with pytest.raises(AudioCheckError, match="NaN"):
        results.check_audio(torch.tensor([0.1, float("nan")]), "a")
    with pytest.raises(AudioCheckError, match="silent"):
        results.check_audio(torch.zeros(960), "a")
    with pytest.raises(NoAudioError):
        results.check_audio(torch.zeros(0), "a")


def test_join_pieces_keeps_whole_frames():
    audio = results.join_pieces([torch.ones(960 * 3), torch.ones(960 * 2)], 8, 960)
    assert audio.shape[0] == 960 * (3 + 8 + 2)
    assert audio[960 * 3: 960 * 11].abs().max() == 0


# --- the synthesizer on the reference checkpoints -----------------------------------------------


@pytest.fixture(scope="module")
def fixture_synth(tiny_a):
    options = SynthOptions(model=str(tiny_a / "lm"), tokenizer=str(tiny_a / "tokenizer"),
                           lm_device="cpu", tokenizer_device="cpu", template=0,
                           temperature=0.0, audio_temperature=0.0, max_new_groups=6)
    synth = pipeline.Synthesizer(options.validate(), env={})
    synth.load()
    return synth


def test_item_key_tracks_every_input(fixture_synth):
    item = Item(id="a", text="hello", source="s")
    key = fixture_synth.item_key(item)
    assert key == fixture_synth.item_key(Item(id="b", text="hello", source="t"))
    assert key != fixture_synth.item_key(Item(id="a", text="hello!", source="s"))
    assert key != fixture_synth.item_key(Item(id="a", text="hello", source="s", seed=1))
    assert key != fixture_synth.item_key(Item(id="a", text="hello", source="s",
                                                  instruct="x"))


def test_run_without_output_dir_reproduces_the_reference(fixture_synth, cases):
    case = next(c for c in cases["groups"]["lm_generate"]["cases"]
                if c["name"] == "gen_tts_en_free_greedy")
    item = Item(id="en", text=case["prompt"]["text"], source="test")
    (result,) = list(fixture_synth.run([item], None))
    assert result.status == "error" and result.exit_code == EXIT_NO_AUDIO
    assert result.generated_text_ids == [case["generated_text_tokens"]]
    assert result.text_out == [case["extracted_text"]]


def test_batched_generation_equals_single(fixture_synth, cases):
    """--batch-size 2 with greedy sampling gives each item its single-run ids."""
    texts = [c["prompt"]["text"] for c in cases["groups"]["lm_forward"]["cases"][:2]]
    items = [Item(id=str(i), text=t, source="test") for i, t in enumerate(texts)]
    single = [list(fixture_synth.run([item], None))[0].generated_text_ids for item in items]
    batched = pipeline.Synthesizer(
        mopts.replace_options(fixture_synth.options, batch_size=2), env={})
    batched.engine, batched.lm_ref, batched.tok_ref = (fixture_synth.engine, fixture_synth.lm_ref,
                                                       fixture_synth.tok_ref)
    assert [r.generated_text_ids for r in batched.run(items, None)] == single
