"""Error paths: each documented exit code, one `Error:` line on stderr, nothing half-written."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from mimo_tts.errors import (
    EXIT_AUDIO_CHECK,
    EXIT_CHECKPOINT,
    EXIT_DEVICE,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_NO_AUDIO,
    EXIT_USAGE,
)

TINY = ("synth", "--model", "tiny")


def _wavs(directory):
    return [p for p in directory.glob("*.wav") if not p.name.startswith(".")]


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("args, match", [
    (("synth", "--model", "tiny"), "nothing to say"),
    ((*TINY, "--text", "x", "--format", "aiff"), "--format"),
    ((*TINY, "--text", "a", "--text", "b", "-o", "-"), "exactly one item"),
    ((*TINY, "--text", "x", "--task", "sing"), "unknown --task 'sing'"),
    ((*TINY, "--text", "x", "--stream", "--batch-size", "2"), "--stream"),
    ((*TINY, "--text", "x", "--raw", "--json"), "--json"),
    ((*TINY, "--text", "x", "--config", "no-such-profile"), "config profile not found"),
    ((*TINY, "--text", "x", "--cuda-graph", "--dtype", "int4"), "dtype 'int4'"),
])
def test_usage_errors_exit_2(invoke, args, match):
    result = invoke(*args)
    assert result.exit_code == EXIT_USAGE
    assert match in _error_line(result.stderr) and result.stdout == ""


def test_unknown_option_is_a_usage_error(mimo):
    proc = mimo("synth", "--no-such-option")
    assert proc.returncode == EXIT_USAGE and b"No such option" in proc.stderr


def test_missing_model_names_the_fetch_command(mimo, tmp_path):
    proc = mimo("synth", "--text", "hi")  # default HF ids, empty HF cache (HF_HOME=tmp)
    assert proc.returncode == EXIT_CHECKPOINT
    line = _error_line(proc.stderr.decode())
    assert "XiaomiMiMo/MiMo-Audio-7B-Instruct" in line and "mimo-tts download" in line
    assert "hf download XiaomiMiMo/MiMo-Audio-7B-Instruct" in line
    assert not (tmp_path / "output_audio").exists() or not any((tmp_path / "output_audio").rglob(
        "*.wav"))


def test_missing_checkpoint_directory(invoke, tmp_path):
    result = invoke("synth", "--model", tmp_path / "nowhere", "--text", "hi")
    assert result.exit_code == EXIT_CHECKPOINT
    assert "not found" in _error_line(result.stderr)


def test_tokenizer_env_path_must_exist(invoke, tmp_path):
    result = invoke("synth", "--model", "tiny", "--text", "hi",
                    env={"MIMO_AUDIO_TOKENIZER_PATH": str(tmp_path / "missing")})
    assert result.exit_code == EXIT_CHECKPOINT
    assert "MIMO_AUDIO_TOKENIZER_PATH" in _error_line(result.stderr)


def test_corrupt_checkpoint(invoke, tmp_path, tiny_cache):
    broken = tmp_path / "lm"
    broken.mkdir()
    source = next(tiny_cache.glob("presets/*/lm"))
    for f in source.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    result = invoke("synth", "--model", broken, "--tokenizer", "tiny", "--text", "hi")
    assert result.exit_code == EXIT_CHECKPOINT
    assert "model.safetensors" in _error_line(result.stderr)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1"])
def test_invalid_device_exit_4(invoke, device):
    result = invoke(*TINY, "--text", "hi", "--tokenizer-device", device)
    assert result.exit_code == EXIT_DEVICE
    line = _error_line(result.stderr)
    assert repr(device) in line and "flag" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda(invoke):
    result = invoke(*TINY, "--text", "hi", env={"MIMO_AUDIO_TOKENIZER_DEVICE": "cuda:0"})
    assert result.exit_code == EXIT_DEVICE
    line = _error_line(result.stderr)
    assert "MIMO_AUDIO_TOKENIZER_DEVICE" in line and "not available" in line


def test_bad_graph_env_value(invoke):
    result = invoke(*TINY, "--text", "hi", env={"MIMO_AUDIO_TOKENIZER_CUDA_GRAPH": "perhaps"})
    assert result.exit_code == EXIT_USAGE and "perhaps" in _error_line(result.stderr)


def test_unwritable_output_dir_exit_5(invoke, tmp_path):
    (tmp_path / "taken").write_text("a file where the output directory should go")
    result = invoke(*TINY, "--text", "hi", "--output-dir", "taken", "--max-new-groups", "1")
    assert result.exit_code == EXIT_IO
    assert "cannot create output directory" in _error_line(result.stderr)


def test_locked_output_dir_exit_5(invoke, tmp_path):
    from mimo_tts.batch.sinks import DirectorySink

    with DirectorySink(tmp_path / "output_audio", "tts_sft"):
        result = invoke(*TINY, "--text", "hi", "--max-new-groups", "1")
    assert result.exit_code == EXIT_IO
    assert "another mimo-tts run" in _error_line(result.stderr)


def test_existing_output_file_is_kept(invoke, tmp_path):
    target = tmp_path / "mine.wav"
    target.write_bytes(b"precious")
    result = invoke(*TINY, "--text", "hi", "-o", target, "--max-new-groups", "1")
    assert result.exit_code == EXIT_IO and target.read_bytes() == b"precious"
    again = invoke(*TINY, "--text", "hi", "-o", target, "--max-new-groups", "1", "--overwrite")
    assert again.exit_code == 0 and target.read_bytes()[:4] == b"RIFF"
    assert (tmp_path / "mine.json").is_file()


def test_bad_single_item_exit_9(invoke, tmp_path):
    result = invoke(*TINY, "--text", "   ")
    assert result.exit_code == EXIT_INPUT and "empty text" in result.stderr
    missing = invoke(*TINY, "--task", "tts_sft_with_audio", "--text", "hi",
                     "--prompt-audio", tmp_path / "none.wav", "--max-new-groups", "1")
    assert missing.exit_code == EXIT_INPUT and "none.wav" in missing.stderr


def test_b_a_missing_prompt_file_is_a_bad_item_before_the_exists_check(invoke, tmp_path):
    voice = tmp_path / "voice.wav"
    sf.write(str(voice), torch.sin(torch.arange(12000) / 9.0).numpy() * 0.3, 24000)
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"id": "x", "text": "Hi.", "prompt_audio": str(voice)}) + "\n")
    args = (*TINY, "--task", "tts_sft_with_audio", "--input", batch, "--max-new-groups", "1")
    assert invoke(*args).exit_code == 0  # x.wav now exists
    batch.write_text(json.dumps({"id": "x", "text": "Hi.", "prompt_audio": "gone.wav"}) + "\n")
    result = invoke(*args)
    assert result.exit_code == EXIT_INPUT, result.stderr  # was: exit 5, "exists from other..."
    assert "b.jsonl:1: prompt audio not found: gone.wav" in result.stderr
    assert "exists" not in result.stderr


def test_nan_audio_fails_the_audio_check_exit_6(invoke, tmp_path, tiny_cache):
    """A tokenizer whose vocoder head is NaN: the item fails, no wav is written."""
    source = next(tiny_cache.glob("presets/*/tokenizer"))
    broken = tmp_path / "tok"
    broken.mkdir()
    (broken / "config.json").write_bytes((source / "config.json").read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    tensors["decoder.vocoder.head.out.bias"] = torch.full_like(
        tensors["decoder.vocoder.head.out.bias"], float("nan"))
    save_file(tensors, str(broken / "model.safetensors"))
    result = invoke(*TINY, "--tokenizer", broken, "--text", "hi", "--max-new-groups", "1",
                    "--json")
    assert result.exit_code == EXIT_AUDIO_CHECK
    assert "NaN" in json.loads(result.stdout)["error"]
    assert not list((tmp_path / "output_audio").rglob("*.wav"))


def test_no_audio_exit_7_on_a_single_item(invoke, tiny_a, cases):
    text = cases["groups"]["lm_generate"]["cases"][3]["prompt"]["text"]
    result = invoke("synth", "--model", tiny_a / "lm", "--tokenizer", tiny_a / "tokenizer",
                    "--text", text, "--template", "0", "--temperature", "0",
                    "--max-new-groups", "2")
    assert result.exit_code == EXIT_NO_AUDIO and "no audio tokens" in result.stderr


def test_download_offline_gives_a_clear_error(mimo):
    proc = mimo("download")
    assert proc.returncode == EXIT_CHECKPOINT
    line = _error_line(proc.stderr.decode())
    assert "could not download XiaomiMiMo/MiMo-Audio-7B-Instruct" in line


def test_debug_shows_a_traceback(invoke):
    quiet = invoke("synth", "--model", "/nonexistent/dir", "--text", "hi")
    loud = invoke("synth", "--model", "/nonexistent/dir", "--text", "hi", "--debug")
    assert "Traceback" not in quiet.stderr and "Traceback" in loud.stderr
    assert quiet.exit_code == loud.exit_code == EXIT_CHECKPOINT


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_interrupt_keeps_complete_outputs_and_resumes(tmp_path, base_env, entry_point, manifest,
                                                      sig):
    """Ctrl-C or kill -9 mid-batch: only complete files; a re-run does exactly the rest."""
    n = 8
    lines = tmp_path / "many.txt"
    lines.write_text("".join(f"Sentence number {i}.\n" for i in range(n)), encoding="utf-8")
    args = [str(entry_point), "synth", "--model", "tiny", "--input", str(lines),
            "--max-new-groups", "2"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=base_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    task_dir = tmp_path / "output_audio" / "tts_sft"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_wavs(task_dir)) < 2:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert proc.returncode == EXIT_INTERRUPTED, stderr.decode()
        assert "re-run the same command to resume" in stderr.decode()
        assert not [p for p in task_dir.iterdir() if p.name.startswith(".mimo-tmp-")]
    else:
        assert proc.returncode == -signal.SIGKILL
    done = {p.stem for p in _wavs(task_dir)}
    assert 2 <= len(done) < n
    for wav in _wavs(task_dir):  # every wav is complete
        assert sf.info(str(wav)).frames == 960 * 8
    assert {r["id"] for r in manifest(task_dir) if r["status"] == "ok"} <= done
    rerun = subprocess.run([*args, "--json"], cwd=tmp_path, env=base_env, capture_output=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()
    statuses = [json.loads(x)["status"] for x in rerun.stdout.decode().splitlines()]
    assert statuses.count("skipped") == len(done) and statuses.count("ok") == n - len(done)
    assert len(manifest(task_dir)) == n and len(_wavs(task_dir)) == n
    assert not [p for p in task_dir.iterdir() if p.name.startswith(".mimo-tmp-")]
