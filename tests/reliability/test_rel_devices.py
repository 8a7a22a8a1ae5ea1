"""Devices: a CUDA index that does not exist, and a real out-of-memory on the CPU (an address
space limit set with setrlimit in the child) turned into exit 4 with advice."""

from __future__ import annotations

import json
import resource

import pytest
import torch

from mimo_tts.errors import EXIT_DEVICE, DeviceError
from mimo_tts.runtime.guards import is_out_of_memory, oom_advice
from tests.helpers import audio_files, error_line, read_lines, temp_files

OOM_ADVICE = "try --tokenizer-device cpu, a smaller --batch-size or a smaller --max-chars"


@pytest.mark.parametrize("flag", ["--lm-device", "--tokenizer-device"])
def test_cuda_index_that_does_not_exist(invoke, flag):
    result = invoke("synth", "--model", "tiny", "--text", "hi", flag, "cuda:99")
    assert result.exit_code == EXIT_DEVICE
    line = error_line(result.stderr)
    assert "'cuda:99' (from flag)" in line
    assert ("does not exist" in line) if torch.cuda.is_available() else ("not available" in line)


def test_a_real_cpu_allocation_failure_is_recognised():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**50)  # more bytes than any address space: the allocator refuses
    assert is_out_of_memory(info.value)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    with pytest.raises(DeviceError, match="out of memory on cpu during a test") as advice:
        with oom_advice("a test", "cpu"):
            torch.empty(2**50)
    assert OOM_ADVICE in str(advice.value) and advice.value.exit_code == EXIT_DEVICE


@pytest.mark.slow
def test_out_of_memory_in_a_run_gives_advice(limited, tmp_path):
    """2048 pieces in one batch, the child may map only 6 GiB in all: whichever stage runs out
    first (the KV cache grows with the run, so today it is joining the 2048 pieces' audio), the
    item fails with exit 4 and the advice."""
    text = " ".join(["Go."] * 2048)
    proc = limited("synth", "--model", "tiny", "--text", text, "--max-chars", "3",
                   "--batch-size", "2048", "--lm-device", "cpu", "--tokenizer-device", "cpu",
                   "--json", limits={resource.RLIMIT_AS: 6 * 2**30})
    assert proc.returncode == EXIT_DEVICE, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["status"] == "error" and record["exit_code"] == EXIT_DEVICE
    assert "out of memory on cpu during " in record["error"]
    assert OOM_ADVICE in record["error"]
    task_dir = tmp_path / "output_audio" / "tts_sft"
    assert not audio_files(task_dir) and not temp_files(task_dir)
    assert read_lines(task_dir / "results.jsonl")[0]["exit_code"] == EXIT_DEVICE
