"""`mimo-tts synth --engine vllm` end to end (the installed console script of this venv): on the
tiny preset in float32, greedy, a 3-item batch writes byte-identical wavs and the same generated
ids as `--engine native`, one-shot and with `--stream` (Stage-1 fed from vLLM's step stream)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mimo_tts.runtime.paths import CACHE_ENV

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/setup_vllm_venv.sh)")


ENTRY_POINT = Path(sys.executable).with_name("mimo-tts")
LINES = "Hello there.\nThe weather is nice today, is it not?\n今天天气真好。\n"
GREEDY = ("--dtype", "float32", "--temperature", "0", "--audio-temperature", "0",
          "--lm-device", "cpu", "--tokenizer-device", "cpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(out_name, *args) -> {item id: (wav bytes, sidecar)} after `mimo-tts synth`
    (`run.stderr`: that run's stderr)."""
    root = tmp_path_factory.mktemp("vllm-cli")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIMO_", "VLLM_"))}
    env.update({CACHE_ENV: str(root / "cache"), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1",
                "OMP_NUM_THREADS": "1"})
    (root / "lines.txt").write_text(LINES, encoding="utf-8")

    def synth(out: str, *args: str) -> dict:
        proc = subprocess.run(
            [str(ENTRY_POINT), "synth", "--model", "tiny", "--input", "lines.txt", *GREEDY,
             "--output-dir", out, "--json", *args],
            cwd=root, env=env, capture_output=True, timeout=240)
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
        synth.stderr = proc.stderr.decode()
        records = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert [r["status"] for r in records] == ["ok"] * 3, records
        found = {}
        for record in records:
            wav = root / record["path"]
            sidecar = json.loads(wav.with_suffix(".json").read_text(encoding="utf-8"))
            found[record["id"]] = (wav.read_bytes(), sidecar)
        return found

    return synth


def _same_outputs(native: dict, vllm: dict) -> None:
    assert list(vllm) == list(native) and len(native) == 3
    for item_id, (wav, sidecar) in vllm.items():
        want_wav, want = native[item_id]
        assert wav == want_wav, item_id
        ids = [p["generated_text_ids"] for p in sidecar["pieces"]]
        assert ids == [p["generated_text_ids"] for p in want["pieces"]] and ids[0], item_id
        assert want["engine"]["cpu_kernel"] is False  # float32: eager
        assert sidecar["engine"]["name"] == "vllm"


def test_vllm_batch_writes_what_native_writes(run):
    native = run("native")
    vllm = run("vllm", "--engine", "vllm", "--max-num-seqs", "4", "--max-model-len", "1024")
    _same_outputs(native, vllm)
    settings = next(iter(vllm.values()))[1]["engine"]["settings"]
    assert settings["max_num_seqs"] == 4 and settings["max_model_len"] == 1024
    assert settings["dtype"] == "float32" and settings["kv_cache_memory_bytes"] == 64 << 20


def test_vllm_stream_writes_what_native_stream_writes(run):
    native = run("native-stream", "--stream")
    vllm = run("vllm-stream", "--stream", "--engine", "vllm")
    _same_outputs(native, vllm)
    assert all(s["stream"] for _, s in vllm.values())


def test_vllm_quiet_leaves_stderr_empty(run):
    """`-q` (issue 13 item 10): vLLM's logs and loading bar, torch's C++ and Python warnings are
    cut to errors; 36 lines and a traceback were printed before."""
    outputs = run("vllm-quiet", "--engine", "vllm", "-q")
    assert len(outputs) == 3 and run.stderr == ""
