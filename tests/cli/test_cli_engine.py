"""`--engine native|vllm` in the main venv (no vLLM): the install hint, option validation, the
engine in preflight, and the VLLMOptions built from a placement. The vLLM runs themselves are
tests/vllm/test_vllm_cli.py (in .vllm-venv)."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from mimo_tts.errors import EXIT_USAGE, UsageError
from mimo_tts.lm.vllm.launch import CPU_KV_CACHE_MIB, vllm_options
from mimo_tts.runtime.devices import Choice, Placement
from mimo_tts.synthesis.options import EngineOptions

TINY = ("synth", "--model", "tiny", "--text", "hello")
no_vllm = pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here")


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@no_vllm
def test_engine_vllm_without_vllm_is_one_line_exit_2(mimo, tmp_path):
    proc = mimo(*TINY, "--engine", "vllm", "--output-dir", "out")
    stderr = proc.stderr.decode()
    assert proc.returncode == EXIT_USAGE, stderr
    assert "pip install 'mimo-tts[vllm]'" in _error_line(stderr)
    assert "Traceback" not in stderr and stderr.strip().count("\n") == 0
    assert proc.stdout == b"" and not (tmp_path / "out").exists()  # failed before any output


@no_vllm
def test_engine_from_profile_key(invoke, tmp_path):
    (tmp_path / "p.toml").write_text('engine = "vllm"\nmax_num_seqs = 4\n')
    result = invoke(*TINY, "--config", "p.toml")
    assert result.exit_code == EXIT_USAGE
    assert "needs vLLM" in _error_line(result.stderr)


@pytest.mark.parametrize("args, match", [
    (("--engine", "tgi"), "--engine must be one of native, vllm"),
    (("--max-num-seqs", "4"), "--max-num-seqs applies to --engine vllm only"),
    (("--gpu-memory-utilization", "0.5"), "--gpu-memory-utilization applies to --engine vllm"),
    (("--engine", "vllm", "--gpu-memory-utilization", "1.5"), "must be in (0, 1]"),
    (("--engine", "vllm", "--max-num-seqs", "0"), "--max-num-seqs must be >= 1"),
    (("--engine", "vllm", "--tensor-parallel-size", "0"), "--tensor-parallel-size must be >= 1"),
    (("--engine", "vllm", "--max-model-len", "1"), "--max-model-len must be in [2, 8192]"),
    (("--engine", "vllm", "--max-model-len", "9000"), "--max-model-len must be in [2, 8192]"),
])
def test_engine_options_are_validated(invoke, args, match):
    result = invoke(*TINY, *args)
    assert result.exit_code == EXIT_USAGE
    assert match in _error_line(result.stderr) and result.stdout == ""


def test_preflight_shows_the_engine(invoke, tmp_path):
    result = invoke("devices", "--model", "tiny", "--engine", "vllm", "--lm-device", "cpu",
                    "--json")
    assert result.exit_code == 0, result.stderr
    engine = json.loads(result.stdout)["engine"]
    assert engine["name"] == "vllm" and engine["installed"] == (find_spec("vllm") is not None)
    assert engine["settings"]["kv_cache_memory_bytes"] == CPU_KV_CACHE_MIB << 20
    assert engine["settings"]["dtype"] == "float32" and engine["settings"]["in_process"]
    # flag > profile: the profile's vllm is overridden by --engine native
    (tmp_path / "p.toml").write_text('engine = "vllm"\n')
    result = invoke("synth", "--model", "tiny", "--text", "x", "--dry-run", "--json",
                    "--config", "p.toml", "--engine", "native")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["engine"] == {"name": "native"}


def _placement(device: str, dtype: str) -> Placement:
    return Placement(Choice(device, "flag"), Choice("cpu", "flag"), Choice(dtype, "flag"),
                     Choice("float32", "default"), Choice(False, "default"))


def test_vllm_options_from_placement():
    o = EngineOptions(engine="vllm", max_num_seqs=8, max_model_len=512)
    cpu = vllm_options(o, _placement("cpu", "float32"))
    assert cpu == {"dtype": "float32", "in_process": True, "max_num_seqs": 8,
                   "max_model_len": 512, "kv_cache_memory_bytes": CPU_KV_CACHE_MIB << 20}
    gpu = vllm_options(EngineOptions(engine="vllm", gpu_memory_utilization=0.5),
                       _placement("cuda", "bfloat16"))
    assert gpu["kv_cache_memory_bytes"] is None and gpu["gpu_memory_utilization"] == 0.5
    assert gpu["dtype"] == "bfloat16" and "max_num_seqs" not in gpu
    sized = vllm_options(EngineOptions(engine="vllm", kv_cache_mib=16),
                         _placement("cuda:0", "float16"))
    assert sized["kv_cache_memory_bytes"] == 16 << 20
    for device, match in (("mps", "not mps"), ("cuda:1", "CUDA_VISIBLE_DEVICES")):
        with pytest.raises(UsageError, match=match):
            vllm_options(o, _placement(device, "float16"))
