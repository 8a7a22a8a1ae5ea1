"""Option checks the CLI gets from `synthesis/options.py`: flags that exclude each other are
refused before loading (exit 2, naming both), the task follows --prompt-audio / --instruct when
--task is not given, and a task's missing input names the flag that gives it."""

from __future__ import annotations

import numpy as np
import soundfile as sf

from mimo_tts.errors import EXIT_PARTIAL, EXIT_USAGE

TINY = ("--model", "tiny", "--lm-device", "cpu", "--tokenizer-device", "cpu",
        "--max-new-groups", "4")


def test_raw_with_a_format_is_refused_naming_both_flags(invoke, tmp_path):
    """--raw writes bare PCM16: a --format was silently ignored (exit 0, PCM on stdout)."""
    result = invoke("synth", *TINY, "--text", "Hello.", "--raw", "--format", "flac")
    assert result.exit_code == EXIT_USAGE, result.stderr
    assert "--raw" in result.stderr and "--format flac" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not list(tmp_path.rglob("*.flac")) and not (tmp_path / "output_audio").exists()


def test_prompt_audio_alone_selects_the_clone_task(invoke, tmp_path):
    """No --task: a voice prompt clones (tts_sft_with_audio), as the task's input implies."""
    rate = 16000
    voice = 0.3 * np.sin(np.arange(rate // 2) * 2 * np.pi * 220 / rate)
    sf.write(tmp_path / "voice.wav", voice.astype(np.float32), rate)
    result = invoke("synth", *TINY, "--text", "Clone me.", "--prompt-audio", "voice.wav")
    assert result.exit_code == 0, result.stderr
    assert len(list((tmp_path / "output_audio" / "tts_sft_with_audio").glob("*.wav"))) == 1


def test_instruct_alone_selects_the_instruct_task(invoke, tmp_path):
    result = invoke("synth", *TINY, "--text", "Calm down.", "--instruct", "calmly")
    assert result.exit_code == 0, result.stderr
    assert len(list((tmp_path / "output_audio" / "tts_sft_with_instruct").glob("*.wav"))) == 1


def test_a_named_task_that_takes_no_such_input_is_still_refused(invoke, tmp_path):
    (tmp_path / "v.wav").write_bytes(b"never read")
    result = invoke("synth", *TINY, "--text", "hi", "--task", "tts_sft", "--prompt-audio",
                    "v.wav")
    assert result.exit_code == EXIT_USAGE and "task tts_sft takes no voice prompt" in result.stderr


def test_a_tasks_missing_input_names_the_flag(invoke, tmp_path):
    """A task without the input it needs, when the flags alone decide it (no item can give
    it): exit 2 naming the flag, before anything is written (before: exit 9 with
    results.jsonl and a lock left behind). A JSONL line without it, beside lines that give
    theirs, fails alone (exit 8 for the mixed batch)."""
    for task, flag in (("tts_sft_with_audio", "--prompt-audio"),
                       ("tts_sft_with_instruct", "--instruct")):
        result = invoke("synth", *TINY, "--text", "hi", "--task", task)
        assert result.exit_code == EXIT_USAGE, result.stderr
        assert f"--task {task} needs" in result.stderr and f"give {flag}" in result.stderr
        assert not (tmp_path / "output_audio").exists()  # no results.jsonl, no lock
    lines = tmp_path / "styles.jsonl"
    lines.write_text('{"text": "Hi.", "instruct": "calm"}\n{"text": "Ho."}\n')
    mixed = invoke("synth", *TINY, "--input", lines, "--task", "tts_sft_with_instruct",
                   "--max-new-groups", "2")
    assert mixed.exit_code == EXIT_PARTIAL, mixed.stderr
    assert "task tts_sft_with_instruct needs a style instruction: give --instruct" in \
        mixed.stderr


