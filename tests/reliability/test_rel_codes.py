"""Issue 13, root causes O and P: a voice prompt too short to encode fails its item (exit 9);
`decode` refuses codes that are not integer [8, T] and bad `pause_frames` metadata, file by
file, while the other files are still decoded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from mimo_tts.errors import EXIT_INPUT, EXIT_OK, EXIT_PARTIAL
from tests.helpers import read_lines


@pytest.mark.parametrize(("samples", "rate"), [(1, 24000), (100, 8000), (900, 24000)])
def test_o_too_short_voice_prompt_fails_the_item(invoke, tmp_path, samples, rate):
    short = tmp_path / "short.wav"
    sf.write(short, np.full(samples, 0.1, dtype=np.float32), rate)
    good = tmp_path / "good.wav"
    sf.write(good, (0.1 * np.random.default_rng(0).standard_normal(4800)).astype(np.float32),
             24000)
    lines = [json.dumps({"id": "short", "text": "Hello.", "prompt_audio": str(short)}),
             json.dumps({"id": "good", "text": "Hello.", "prompt_audio": str(good)})]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    result = invoke("synth", "--model", "tiny", "--task", "tts_sft_with_audio", "--input",
                    tmp_path / "batch.jsonl", "--output-dir", tmp_path / "out")
    assert result.exit_code == EXIT_PARTIAL, result.stderr
    assert "a voice prompt needs at least 40 ms" in result.stderr
    records = {r["id"]: r for r in read_lines(tmp_path / "out" / "tts_sft_with_audio" /
                                                  "results.jsonl")}
    assert records["short"]["exit_code"] == EXIT_INPUT and records["good"]["status"] == "ok"


def _codes_file(path, tensor, metadata=None):
    meta = {"format": "mimo-tts-codes", "metadata": json.dumps(metadata or {})}
    save_file({"codes.0": tensor}, str(path), metadata=meta)
    return path


CODES = torch.randint(0, 120, (8, 12), dtype=torch.int32)
BAD = {
    "seven": (CODES[:7], None, "shape [7, 12]"),
    "floats": (CODES.float() + 0.5, None, "torch.float32 values"),
    "empty": (CODES[:, :0], None, "shape [8, 0]"),
    "pause-string": (CODES, {"pause_frames": "abc"}, "pause_frames must be an integer"),
    "pause-huge": (CODES, {"pause_frames": 10**12}, "pause_frames must be an integer"),
    "pause-negative": (CODES, {"pause_frames": -3}, "pause_frames must be an integer"),
}


@pytest.mark.parametrize("case", BAD)
def test_p_decode_refuses_bad_codes_file_by_file(invoke, tmp_path, case):
    tensor, metadata, message = BAD[case]
    bad = _codes_file(tmp_path / f"{case}.codes.safetensors", tensor.contiguous(), metadata)
    good = _codes_file(tmp_path / "good.codes.safetensors", CODES, {"pause_frames": 8})
    result = invoke("decode", bad, good, "--tokenizer", "tiny")
    assert result.exit_code == EXIT_PARTIAL, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "good.decoded.wav").stat().st_size > 44
    assert not (tmp_path / f"{case}.decoded.wav").exists()
    alone = invoke("decode", good, "--tokenizer", "tiny", "-o", tmp_path / "again.wav")
    assert alone.exit_code == EXIT_OK
