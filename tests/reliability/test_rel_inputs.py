"""Bad input in a batch: every bad line and every bad voice prompt fails alone, with its line
number or file and its cause (exit 9 per item), while the good items are written."""

from __future__ import annotations

import json

import numpy as np
import soundfile as sf

from mimo_tts.errors import EXIT_INPUT, EXIT_PARTIAL, EXIT_USAGE

TINY = ("synth", "--model", "tiny", "--max-new-groups", "1", "--output-dir", "out")


def _jsonl(rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                    for r in rows)


def test_messy_text_batch(invoke, tmp_path, manifest):
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(_jsonl([
        {"id": "good", "text": "A good line."},                     # 1
        {"id": "blank", "text": "  \t "},                            # 2 whitespace only
        {"id": "bell", "text": "ring\u0007bell"},                    # 3 control character
        {"id": "extra", "text": "x", "speaker": "bob"},              # 4 unknown field
        {"id": "good", "text": "Same id again."},                    # 5 duplicate id
        {"id": "../../outside", "text": "Path escape."},             # 6 sanitised
        {"id": "con", "text": "Reserved device name."},              # 7 sanitised
        {"id": "sub/dir\\name", "text": "Separators."},              # 8 sanitised
        b'{"id": "broken", "text": ',                                # 9 malformed JSON
        b'{"id": "latin", "text": "caf\xe9"}',                       # 10 invalid UTF-8
        {"id": "tab", "text": "tab\there"},                          # 11 fine: a tab
        b"[1, 2]",                                                   # 12 not an object
        {"id": "badseed", "text": "x", "seed": "7"},                 # 13 bad seed
    ]))
    lines = tmp_path / "lines.txt"
    lines.write_bytes(b"Plain line.\nctrl \x01 char\nbad \xff byte\n")
    result = invoke(*TINY, "--input", batch, "--input", lines)
    assert result.exit_code == EXIT_PARTIAL, result.stderr
    task_dir = tmp_path / "out" / "tts_sft"
    by_id = {r["id"]: r for r in manifest(task_dir)}
    ok = {i for i, r in by_id.items() if r["status"] == "ok"}
    assert {"good", "outside", "_con", "sub_dir_name", "tab"} <= ok and len(ok) == 6
    assert by_id["good"]["text"] == "A good line."  # the duplicate did not replace it
    assert by_id["tab"]["text"] == "tab here"
    expected = {
        "blank": "batch.jsonl:2: empty text",
        "bell": "batch.jsonl:3: text has control character U+0007",
        "extra": "batch.jsonl:4: unknown field(s) speaker",
        "good-line-5": "batch.jsonl:5: duplicate id 'good' (first at batch.jsonl:1)",
        "line-00009": "batch.jsonl:9: malformed JSON",
        "line-00010": "batch.jsonl:10: invalid UTF-8 at byte",
        "line-00012": "batch.jsonl:12: expected a JSON object",
        "badseed": "batch.jsonl:13: seed must be an integer",
    }
    for item_id, message in expected.items():
        record = by_id[item_id]
        assert record["status"] == "error" and record["exit_code"] == EXIT_INPUT
        assert message in record["error"], record
        assert f"failed {item_id}: {message}" in result.stderr
    txt_errors = sorted(r["error"] for r in by_id.values()
                        if r["source"].startswith("lines.txt") and r["status"] == "error")
    assert txt_errors[0].startswith("lines.txt:2: text has control character U+0001")
    assert txt_errors[1].startswith("lines.txt:3: invalid UTF-8 at byte 4")
    # every file stays inside the task directory, one audio file per good item
    assert sorted(p.stem for p in task_dir.glob("*.wav")) == sorted(ok)
    assert all(p.parent == task_dir for p in tmp_path.rglob("*.wav"))
    assert not list(tmp_path.parent.glob("outside*")) and not (tmp_path / "outside.wav").exists()


def _tone(seconds: float, rate: int, channels: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    tones = [0.3 * np.sin(2 * np.pi * (200 + 70 * c) * t) for c in range(channels)]
    return np.stack(tones, axis=1).astype("float32")


def _voice_files(root):
    sf.write(str(root / "three.wav"), _tone(0.5, 8000, 3), 8000)  # 8 kHz, 3 channels
    sf.write(str(root / "stereo.flac"), _tone(0.5, 44100, 2), 44100)  # FLAC 44.1 kHz stereo
    sf.write(str(root / "long.wav"), _tone(61.0, 8000, 1), 8000)  # > 60 s: segmented
    (root / "junk.wav").write_bytes(b"definitely not audio")
    (root / "cut.wav").write_bytes((root / "three.wav").read_bytes()[:30])
    sf.write(str(root / "empty.wav"), np.zeros((0, 1), "float32"), 16000)
    nan = _tone(0.2, 16000, 1)
    nan[5] = np.nan
    sf.write(str(root / "nan.wav"), nan, 16000, subtype="FLOAT")
    inf = _tone(0.2, 16000, 1)
    inf[7] = np.inf
    sf.write(str(root / "inf.wav"), inf, 16000, subtype="FLOAT")


def test_voice_prompt_audio_cases(invoke, tmp_path, manifest):
    _voice_files(tmp_path)
    cases = {"three": "three.wav", "stereo": "stereo.flac", "long": "long.wav",
             "missing": "nowhere.wav", "junk": "junk.wav", "cut": "cut.wav",
             "empty": "empty.wav", "nan": "nan.wav", "inf": "inf.wav"}
    batch = tmp_path / "voices.jsonl"
    batch.write_bytes(_jsonl({"id": k, "text": "Hello there.", "prompt_audio": str(tmp_path / v)}
                             for k, v in cases.items()))
    result = invoke(*TINY, "--task", "tts_sft_with_audio", "--input", batch)
    assert result.exit_code == EXIT_PARTIAL, result.stderr
    by_id = {r["id"]: r for r in manifest(tmp_path / "out" / "tts_sft_with_audio")}
    reasons = {"missing": "not found", "junk": "unreadable or unsupported",
               "cut": "unreadable or unsupported", "empty": "has no samples",
               "nan": "NaN or infinite", "inf": "NaN or infinite"}
    for item_id, reason in reasons.items():
        record = by_id[item_id]
        assert record["status"] == "error" and record["exit_code"] == EXIT_INPUT
        assert cases[item_id] in record["error"] and reason in record["error"], record
    # any rate / channel count is mixed down and resampled: 0.5 s -> 13 frames -> 16 (4 groups);
    # 61 s -> 6101 mel frames -> segments of 6000 + 101 -> 1500 + 26 frames -> 1528 (382 groups)
    frames = {"three": 16, "stereo": 16, "long": 1528}
    for item_id, n in frames.items():
        assert by_id[item_id]["status"] == "ok", by_id[item_id]
        sidecar = json.loads((tmp_path / by_id[item_id]["path"]).with_suffix(".json").read_text())
        assert f"[AUDIO {n} frames = {n // 4} groups]" in sidecar["pieces"][0]["rendered_prompt"]


def test_prompt_audio_with_a_task_that_takes_none_is_a_usage_error(invoke, tmp_path):
    (tmp_path / "v.wav").write_bytes(b"never read")
    # a named --task (without one, --prompt-audio / --instruct pick the task that takes them)
    result = invoke("synth", "--model", "tiny", "--text", "hi", "--task", "tts_sft",
                    "--prompt-audio", tmp_path / "v.wav")
    assert result.exit_code == EXIT_USAGE
    assert "task tts_sft takes no voice prompt" in result.stderr
    instruct = invoke("synth", "--model", "tiny", "--text", "hi", "--task", "tts_sft",
                      "--instruct", "calm")
    assert instruct.exit_code == EXIT_USAGE and "takes no instruction" in instruct.stderr
