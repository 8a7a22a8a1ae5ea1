"""Every task through the CLI: on the tiny preset (audio out) and on the tiny-a reference
checkpoints (greedy ids equal to the reference implementation's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from tests.helpers import find_case

SPF = 960
TASKS = ("tts_sft", "tts_sft_with_instruct", "tts_sft_with_audio",
         "tts_sft_with_natural_instruction")
GREEDY = ("--temperature", "0", "--audio-temperature", "0")


def _fixture_args(tiny_a):
    return ("--model", tiny_a / "lm", "--tokenizer", tiny_a / "tokenizer")


@pytest.fixture(scope="module")
def voice_wav(tmp_path_factory, case_tensors):
    """The reference voice prompt (encode_chirp_1p3s input) as a float WAV at 24 kHz."""
    audio = case_tensors("codec_encode")["encode_chirp_1p3s.waveform_in"].numpy()
    path = tmp_path_factory.mktemp("voice") / "chirp.wav"
    sf.write(str(path), audio, 24000, subtype="FLOAT")
    return path


@pytest.fixture(scope="module")
def stereo_16k(tmp_path_factory):
    """A 1 s stereo 16 kHz prompt: the CLI must mix it down and resample it."""
    t = np.arange(16000) / 16000
    audio = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)], 1)
    path = tmp_path_factory.mktemp("voice16k") / "stereo.wav"
    sf.write(str(path), audio.astype("float32"), 16000)
    return path


def _task_args(task, voice):
    extra = {"tts_sft_with_instruct": ("--instruct", "calm and slow"),
             "tts_sft_with_audio": ("--prompt-audio", voice),
             "tts_sft_with_natural_instruction": ()}.get(task, ())
    return ("--task", task, *extra)


@pytest.mark.parametrize("task", TASKS)
def test_each_task_on_the_tiny_preset_writes_audio(invoke, tmp_path, task, stereo_16k, manifest):
    result = invoke("synth", "--model", "tiny", "--text", "Hello there.",
                    *_task_args(task, stereo_16k), "--max-new-groups", "3", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    record = json.loads(result.stdout)
    path = tmp_path / "output_audio" / task / f"{record['id']}.wav"
    assert record["path"] == str(path.relative_to(tmp_path)) and record["task"] == task
    assert sf.info(str(path)).frames == SPF * 4 * 3
    sidecar = json.loads(path.with_suffix(".json").read_text())
    rendered = sidecar["pieces"][0]["rendered_prompt"]
    if task == "tts_sft":
        assert rendered.endswith("<|sostm|>")
    else:
        assert rendered.endswith("<|im_start|>assistant\n<think>\n")
    if task == "tts_sft_with_audio":  # 1 s at 25 Hz = 25 frames, padded to 28 = 7 groups
        assert "<|sosp|>[AUDIO 28 frames = 7 groups]<|eosp|>" in rendered
    if task == "tts_sft_with_natural_instruction":
        assert sidecar["pieces"][0]["template_index"] is None
    assert manifest(tmp_path / "output_audio" / task)[0]["status"] == "ok"


@pytest.mark.slow
def test_free_greedy_fixture_case_generates_no_audio(mimo, tmp_path, tiny_a, cases,
                                                     case_tensors):
    """tiny-a, fixed template, temperature 0, 6 groups: the reference's ids, exit 7, no wav."""
    case = find_case(cases, "gen_tts_en_free_greedy")
    prompt = case["prompt"]
    proc = mimo("synth", *_fixture_args(tiny_a), "--text", prompt["text"],
                "--template", prompt["template_choice"]["index"], *GREEDY,
                "--max-new-groups", case["params"]["max_new_groups"], "--json")
    assert proc.returncode == 7, proc.stderr.decode()
    record = json.loads(proc.stdout)
    new_ids = case_tensors("lm_generate")["gen_tts_en_free_greedy.new_ids"]
    assert record["generated_text_ids"] == [case["generated_text_tokens"]]
    assert record["generated_text_ids"][0] == new_ids[0, ::4].tolist()
    assert record["generated_text"] == [case["extracted_text"]]
    assert record["template_index"] == prompt["template_choice"]["index"]
    assert record["status"] == "error" and record["exit_code"] == 7 and record["path"] is None
    assert "no audio" in record["error"]
    task_dir = tmp_path / "output_audio" / "tts_sft"
    assert not list(task_dir.glob("*.wav")) and not list(task_dir.glob("*.json"))
    (line,) = [json.loads(x) for x in (task_dir / "results.jsonl").read_text().splitlines()]
    assert line["generated_text_ids"] == record["generated_text_ids"]


def test_voice_prompt_fixture_case(invoke, tiny_a, cases, voice_wav):
    """The voice-clone prompt from a real audio file reproduces the reference greedy ids."""
    case = find_case(cases, "gen_tts_voice_free_greedy")
    prompt = case["prompt"]
    result = invoke("synth", *_fixture_args(tiny_a), "--task", "tts_sft_with_audio",
                    "--text", prompt["text"], "--instruct", prompt["instruct"],
                    "--prompt-audio", voice_wav,
                    "--template", prompt["template_choice"]["index"], *GREEDY,
                    "--max-new-groups", case["params"]["max_new_groups"], "--json")
    assert result.exit_code == 7, result.stderr
    assert json.loads(result.stdout)["generated_text_ids"] == [case["generated_text_tokens"]]


@pytest.mark.parametrize("name, task", [("prefill_tts_instruct", "tts_sft_with_instruct"),
                                        ("prefill_tts_zh", "tts_sft")])
def test_instruct_and_chinese_prompts_match_the_reference_prefill(invoke, tiny_a, cases, name,
                                                                  task):
    """The first greedy token is the reference prefill's argmax (so the prompt ids match)."""
    case = find_case(cases, name)
    prompt = case["prompt"]
    args = ["--instruct", prompt["instruct"]] if prompt["instruct"] else []
    result = invoke("synth", *_fixture_args(tiny_a), "--task", task, "--text", prompt["text"],
                    *args, "--template", prompt["template_choice"]["index"], *GREEDY,
                    "--max-new-groups", "1", "--json")
    record = json.loads(result.stdout)
    assert record["generated_text_ids"][0] == [case["text_argmax"]]
    assert result.exit_code == (0 if case["text_argmax"] == 5 else 7)  # 5 = <|empty|> here


def test_natural_instruction_on_the_fixture(invoke, tiny_a, cases):
    """Natural layout on tiny-a: the CLI's first greedy token equals the library's argmax."""
    import torch

    from mimo_tts.lm.generate import GenerationOptions, prefill
    from mimo_tts.lm.load import load_lm
    from mimo_tts.lm.prompts import build_prompt
    from mimo_tts.lm.text import TextTokenizer

    text = "用温柔的声音说：今天天气真好。"
    result = invoke("synth", *_fixture_args(tiny_a), "--task",
                    "tts_sft_with_natural_instruction", "--text", text, *GREEDY,
                    "--max-new-groups", "1", "--json")
    record = json.loads(result.stdout)
    assert record["template_index"] is None
    lm = load_lm(tiny_a / "lm")
    tok = TextTokenizer.from_dir(tiny_a / "lm")
    built = build_prompt("tts_sft_with_natural_instruction", text, tok,
                         lm.cfg.speech_empty_ids)

    with torch.inference_mode():
        state = prefill(lm, [built.input_ids], GenerationOptions.for_task("tts"), tok.special)
        expected = int(lm.text_logits(state.hidden).argmax(-1)[0])
    assert record["generated_text_ids"] == [[expected]]
    assert result.exit_code in (0, 7) and record["exit_code"] == result.exit_code
