"""mimo_tts.batch.results (exit codes), the audio checks in mimo_tts.io and mimo_tts.batch (resume
keys, batching, the runner's sinks) on the reference checkpoints."""

from __future__ import annotations

import pytest
import torch

from mimo_tts.batch.items import Item
from mimo_tts.batch.results import ItemResult, exit_code_for
from mimo_tts.batch.runner import BatchRunner
from mimo_tts.batch.sinks import MemorySink
from mimo_tts.errors import (
    EXIT_INPUT,
    EXIT_NO_AUDIO,
    EXIT_OK,
    EXIT_PARTIAL,
    AudioCheckError,
    NoAudioError,
)
from mimo_tts.synthesis.audio import check_audio, join_pieces
from mimo_tts.synthesis.settings import resolve

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
    check_audio(torch.tensor([0.0, 0.2]), "a")
    with pytest.raises(AudioCheckError, match="NaN"):
        check_audio(torch.tensor([0.1, float("nan")]), "a")
    with pytest.raises(AudioCheckError, match="silent"):
        check_audio(torch.zeros(960), "a")
    with pytest.raises(NoAudioError):
        check_audio(torch.zeros(0), "a")


def test_join_pieces_keeps_whole_frames():
    audio = join_pieces([torch.ones(960 * 3), torch.ones(960 * 2)], (0, 960 * 8, 0))
    assert audio.shape[0] == 960 * (3 + 8 + 2)
    assert audio[960 * 3: 960 * 11].abs().max() == 0


def test_join_pieces_puts_each_pause_where_it_is_asked_to_the_sample():
    audio = join_pieces([torch.ones(5), torch.ones(7)], (3, 11, 2))
    assert audio.tolist() == [0] * 3 + [1] * 5 + [0] * 11 + [1] * 7 + [0] * 2


# --- the runner on the reference checkpoints ----------------------------------------------------


@pytest.fixture(scope="module")
def fixture_runner(tiny_a):
    settings = resolve({"model": str(tiny_a / "lm"), "tokenizer": str(tiny_a / "tokenizer"),
                        "lm_device": "cpu", "tokenizer_device": "cpu", "template": 0,
                        "temperature": 0.0, "audio_temperature": 0.0, "max_new_groups": 6},
                       env={})
    runner = BatchRunner(settings, env={})
    runner.ensure_loaded()
    return runner


def test_item_key_tracks_every_input(fixture_runner):
    item = Item(id="a", text="hello", source="s")
    key = fixture_runner.item_key(item)
    assert key == fixture_runner.item_key(Item(id="b", text="hello", source="t"))
    assert key != fixture_runner.item_key(Item(id="a", text="hello!", source="s"))
    assert key != fixture_runner.item_key(Item(id="a", text="hello", source="s", seed=1))
    assert key != fixture_runner.item_key(Item(id="a", text="hello", source="s",
                                               instruct="x"))


def test_run_into_memory_reproduces_the_reference(fixture_runner, cases):
    case = next(c for c in cases["groups"]["lm_generate"]["cases"]
                if c["name"] == "gen_tts_en_free_greedy")
    item = Item(id="en", text=case["prompt"]["text"], source="test")
    (result,) = list(fixture_runner.run([item], MemorySink()))
    assert result.status == "error" and result.exit_code == EXIT_NO_AUDIO
    assert result.generated_text_ids == [case["generated_text_tokens"]]
    assert result.text_out == [case["extracted_text"]]


def test_batched_generation_equals_single(fixture_runner, cases):
    """--batch-size 2 with greedy sampling gives each item its single-run ids."""
    texts = [c["prompt"]["text"] for c in cases["groups"]["lm_forward"]["cases"][:2]]
    items = [Item(id=str(i), text=t, source="test") for i, t in enumerate(texts)]
    single = [list(fixture_runner.run([item], MemorySink()))[0].generated_text_ids
              for item in items]
    batched = BatchRunner(fixture_runner.settings.replace(batch_size=2), env={})
    batched.tts, batched.refs = fixture_runner.tts, fixture_runner.refs
    assert [r.generated_text_ids for r in batched.run(items, MemorySink())] == single


def test_resume_keys_of_an_unchanged_command_stay_as_they_were():
    """Outputs of earlier versions are skipped only while the keys they carry are computed
    alike: these were computed before the key was split into its run and item parts."""
    from types import SimpleNamespace

    from mimo_tts.batch.runner import item_key

    refs = (SimpleNamespace(path="/m/lm", revision="r1"),
            SimpleNamespace(path="/m/tok", revision=None))
    fixed = {"model": "tiny", "lm_device": "cpu", "tokenizer_device": "cpu", "dtype": "float32",
             "tokenizer_dtype": "float32"}
    cases = [
        ({}, Item(id="a", text="Hello there.", source="x"), 0, "820833c6d60b0f8c"),
        ({"task": "tts_sft_with_instruct", "instruct": "calm", "seed": 3, "format": "flac",
          "stream": True, "stream_mode": "official"},
         # was 77dec10ae31cfbbe: the official scheme's audio follows the pushes, and since
         # issue 24 the first push is the decoder's look-ahead plus one group
         Item(id="a", text="Hello there.", source="x", seed=7), 7, "bef7c3857a5ebcfe"),
        ({"task": "tts_sft_with_audio", "prompt_audio": "/nowhere/v.wav", "batch_size": 4,
          "engine": "vllm"}, Item(id="a", text="Hello there.", source="x", instruct="slow"), 0,
         "5b670d84888bd927"),
    ]
    for given, item, seed, key in cases:
        assert item_key(resolve({**fixed, **given}, env={}), refs, item, seed) == key
