"""Generated audio that must not be written: silent output (a real silent vocoder) and codes
out of range (real codes files through `mimo-tts decode`); NaN audio and "no audio tokens" are
covered in tests/cli/test_cli_errors.py."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from mimo_tts.batch import files as mio
from mimo_tts.errors import EXIT_AUDIO_CHECK, EXIT_PARTIAL


def test_silent_audio_fails_the_item_exit_6(invoke, preset_copy, tmp_path):
    """A vocoder head whose magnitudes are exp(-20): the item fails, no file is written."""
    tok = preset_copy("tokenizer")
    tensors = load_file(str(tok / "model.safetensors"))
    head = "decoder.vocoder.head.out"
    half = tensors[f"{head}.bias"].shape[0] // 2  # log-magnitude, then phase (spec §3.6)
    tensors[f"{head}.weight"] = torch.zeros_like(tensors[f"{head}.weight"])
    tensors[f"{head}.bias"] = torch.cat([torch.full((half,), -20.0), torch.zeros(half)])
    save_file(tensors, str(tok / "model.safetensors"))
    result = invoke("synth", "--model", "tiny", "--tokenizer", tok, "--text", "Quiet please.",
                    "--max-new-groups", "2", "--json")
    assert result.exit_code == EXIT_AUDIO_CHECK, result.stderr
    record = json.loads(result.stdout)
    assert record["status"] == "error" and "decoded audio is silent" in record["error"]
    task_dir = tmp_path / "output_audio" / "tts_sft"
    assert {p.name for p in task_dir.iterdir()} == {"results.jsonl", ".mimo-tts.lock"}


def test_codes_out_of_range_fail_alone_in_decode(invoke, tmp_path):
    gen = torch.Generator().manual_seed(0)
    good = torch.cat([torch.randint(0, 1024, (2, 12), generator=gen),
                      torch.randint(0, 128, (6, 12), generator=gen)])
    bad = good.clone()
    bad[3, 5] = 500  # codebook 3 has 128 entries
    mio.save_codes(tmp_path / "good.codes.safetensors", [good], {"pause_frames": 8})
    mio.save_codes(tmp_path / "bad.codes.safetensors", [bad], {"pause_frames": 8})
    (tmp_path / "junk.codes.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    files = [tmp_path / f"{n}.codes.safetensors" for n in ("good", "bad", "junk")]
    result = invoke("decode", *files, "--tokenizer", "tiny")
    assert result.exit_code == EXIT_PARTIAL, result.stderr
    assert "code 500 at codebook 3, frame 5 is out of range [0, 128)" in result.stderr
    assert "failed " + str(files[2]) + ": unreadable codes file" in result.stderr
    assert result.stdout.strip() == str(tmp_path / "good.decoded.wav")
    assert sorted(p.name for p in tmp_path.glob("*.wav")) == ["good.decoded.wav"]
    alone = invoke("decode", files[1], "--tokenizer", "tiny")
    assert alone.exit_code == EXIT_AUDIO_CHECK and "out of range" in alone.stderr
