"""Devices: a CUDA index that does not exist, and a real out-of-memory on the CPU (an address
space limit set with setrlimit in the child) turned into exit 4 with advice."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mimo_tts.errors import EXIT_DEVICE, DeviceError
from mimo_tts.runtime.guards import is_out_of_memory, oom_advice
from tests.helpers import ENTRY_POINT, audio_files, error_line, read_lines, temp_files

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


def _address_space_peak(base_env, cwd, *args) -> int:
    """Run `mimo-tts *args` unlimited; the most address space it held (VmPeak, the kernel's own
    high-water mark, read from /proc until it exits), in bytes."""
    proc = subprocess.Popen([str(ENTRY_POINT), *args], cwd=cwd, env=base_env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    peak = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            found = re.search(r"^VmPeak:\s+(\d+) kB", status.read_text(), re.MULTILINE)
        except OSError:  # it has just exited
            break
        if found:
            peak = max(peak, int(found.group(1)) * 1024)
        time.sleep(0.01)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    return peak


@pytest.mark.slow
def test_out_of_memory_in_a_run_gives_advice(limited, base_env, tmp_path):
    """A run that outgrows its address space (setrlimit in the child): whichever stage runs out
    first (today Stage-1's decode of the batch), the item fails with exit 4 and the advice, and
    nothing is left half-written. The limit is this machine's own, so the run fails in its work,
    never in its imports: the peak of a one-piece run plus 256 MiB, where 512 pieces in one
    batch need about 1 GiB more than one (AMD EPYC, 2026-12-07: 3.5 against 4.5 GiB)."""
    common = ("--model", "tiny", "--max-chars", "3", "--lm-device", "cpu",
              "--tokenizer-device", "cpu", "--json")
    scratch = tmp_path / "one"
    scratch.mkdir()
    one = _address_space_peak(base_env, scratch, "synth", "--text", "Go.", *common)
    text = " ".join(["Go."] * 512)
    proc = limited("synth", "--text", text, "--batch-size", "512", *common,
                   limits={resource.RLIMIT_AS: one + 256 * 2**20})
    assert proc.returncode == EXIT_DEVICE, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert record["status"] == "error" and record["exit_code"] == EXIT_DEVICE
    assert "out of memory on cpu during " in record["error"]
    assert OOM_ADVICE in record["error"]
    task_dir = tmp_path / "output_audio" / "tts_sft"
    assert not audio_files(task_dir) and not temp_files(task_dir)
    assert read_lines(task_dir / "results.jsonl")[0]["exit_code"] == EXIT_DEVICE
