"""mimo_tts.batch.items (items, ids, text), mimo_tts.io (atomic writes, audio, codes files) and
mimo_tts.outputs (manifest, lock)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import soundfile as sf
import torch

from mimo_tts.batch import files as mio
from mimo_tts.batch import items as inputs
from mimo_tts.batch import sinks as outputs
from mimo_tts.errors import EXIT_INPUT, InputError, OutputError
from mimo_tts.runtime.paths import TEMP_MARK, atomic_write, clean_temp_files, write_json
from mimo_tts.synthesis.audio import FORMATS, pcm16, read_audio, resample, write_audio
from mimo_tts.synthesis.text import clean_text, split_text

# --- ids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, expected", [
    ("hello", "hello"),
    ("../../etc/passwd", "etc_passwd"),
    ("a/b\\c", "a_b_c"),
    ("..", "item"),
    ("  ", "item"),
    ("con", "_con"),
    ("NUL.txt", "_NUL.txt"),
    ("lpt1", "_lpt1"),
    ("x..y", "x.y"),
    ("你好 世界", "你好_世界"),
    (".hidden", "hidden"),
])
def test_sanitize_id(raw, expected):
    assert inputs.sanitize_id(raw) == expected


def test_sanitized_ids_are_bounded_and_never_escape():
    for raw in ["a" * 500, "../" * 50 + "x", "/abs/path", "~/x", "\x00bad"]:
        out = inputs.sanitize_id(raw)
        assert len(out.encode()) <= inputs.MAX_ID_BYTES
        assert "/" not in out and "\\" not in out and ".." not in out and "\x00" not in out
        assert not out.startswith(".")


def test_text_id_is_stable_and_distinct():
    assert inputs.text_id("Hello there") == inputs.text_id("Hello there")
    assert inputs.text_id("Hello there") != inputs.text_id("Hello there!")
    assert inputs.text_id("Hello there").startswith("Hello_there-")


# --- text ---------------------------------------------------------------------------------------


def test_clean_text_collapses_whitespace():
    assert clean_text("  a\tb\n c ", "x") == "a b c"


@pytest.mark.parametrize("bad, match", [("", "empty"), (" \t\n", "empty"),
                                        ("bell\x07", "U\\+0007 at 4"), ("nul\x00x", "U\\+0000")])
def test_clean_text_refuses(bad, match):
    with pytest.raises(InputError, match=match) as info:
        clean_text(bad, "file.txt:3")
    assert "file.txt:3" in str(info.value) and info.value.exit_code == EXIT_INPUT


def test_split_text_on_sentences_within_limit():
    text = "One two three. Four five six! Seven eight nine? Ten."
    pieces = split_text(text, 20)
    assert all(len(p) <= 20 for p in pieces)
    assert " ".join(pieces) == text
    assert pieces[0] == "One two three."


def test_split_text_hard_splits_long_sentences_and_cjk():
    long = "word " * 30
    pieces = split_text(long.strip(), 25)
    assert all(len(p) <= 25 for p in pieces) and " ".join(pieces) == long.strip()
    zh = "今天天气真好。我们一起去公园散步吧！" * 3
    pieces = split_text(zh, 20)
    assert all(len(p) <= 20 for p in pieces) and "".join(p.replace(" ", "") for p in pieces) == zh


def test_split_text_disabled_or_short():
    assert split_text("short", 300) == ["short"]
    assert split_text("x. " * 200, 0) == ["x. " * 200]


# --- reading items ------------------------------------------------------------------------------


def test_txt_items_skip_blank_lines_and_report_bad_utf8(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes(b"first line\n\n  \nsecond \xff line\nthird\n")
    items = inputs.read_items([], [str(path)])
    assert [i.text for i in items if i.error is None] == ["first line", "third"]
    bad = [i for i in items if i.error is not None]
    assert len(bad) == 1 and "lines.txt:4" in str(bad[0].error) and "UTF-8" in str(bad[0].error)


def test_jsonl_items(tmp_path):
    path = tmp_path / "batch.jsonl"
    lines = [
        {"id": "a", "text": "alpha", "seed": 3, "instruct": "calm"},
        {"id": "../escape", "text": "beta"},
        {"id": "a", "text": "duplicate"},
        {"text": "gamma", "colour": "red"},
        {"id": "s", "text": "bad seed", "seed": -1},
    ]
    raw = "\n".join(json.dumps(x) for x in lines) + "\n{not json\n[1, 2]\n"
    path.write_text(raw, encoding="utf-8")
    items = inputs.read_items([], [str(path)])
    assert len(items) == 7
    a, esc, dup, unknown, seed, malformed, array = items
    assert (a.id, a.seed, a.instruct, a.error) == ("a", 3, "calm", None)
    assert esc.id == "escape" and esc.source_id == "../escape" and esc.error is None
    assert "duplicate id 'a'" in str(dup.error) and "batch.jsonl:1" in str(dup.error)
    assert "unknown field(s) colour" in str(unknown.error)
    assert "seed" in str(seed.error)
    assert "batch.jsonl:6" in str(malformed.error) and "malformed JSON" in str(malformed.error)
    assert "JSON object" in str(array.error)


def test_text_flags_and_derived_duplicates():
    items = inputs.read_items(["same", "same", "other"], [])
    assert len({i.id for i in items}) == 3 and items[1].id == items[0].id + "-2"
    assert all(i.error is None for i in items)


def test_stdin_items_detect_jsonl():
    class Stdin(io.StringIO):
        def isatty(self):
            return False

    plain = inputs.read_items([], ["-"], Stdin("one\ntwo\n"))
    assert [i.text for i in plain] == ["one", "two"]
    jsonl = inputs.read_items([], ["-"], Stdin('{"id": "x", "text": "hi"}\n'))
    assert (jsonl[0].id, jsonl[0].text) == ("x", "hi")
    whole = inputs.read_items(["-"], [], Stdin("all of\nthis text"))
    assert [i.text for i in whole] == ["all of this text"]


def test_stdin_on_a_terminal_is_refused():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    with pytest.raises(InputError, match="terminal"):
        inputs.read_items(["-"], [], Tty(""))


def test_missing_input_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        inputs.read_items([], [str(tmp_path / "nope.txt")])


# --- atomic writes, audio, codes ----------------------------------------------------------------


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")

    def boom(handle):
        handle.write(b"partial")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError):
        atomic_write(target, boom)
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_write_to_missing_dir_is_output_error(tmp_path):
    with pytest.raises(OutputError, match="cannot write"):
        write_json(tmp_path / "missing" / "x.json", {})


def test_clean_temp_files(tmp_path):
    (tmp_path / f"{TEMP_MARK}123-a.wav").write_bytes(b"x")
    (tmp_path / "keep.wav").write_bytes(b"x")
    removed = clean_temp_files(tmp_path)
    assert len(removed) == 1 and [p.name for p in tmp_path.iterdir()] == ["keep.wav"]


def test_pcm16_clips_and_rounds():
    data = np.frombuffer(pcm16(torch.tensor([0.0, 0.5, 1.0, -1.0, 2.0, -2.0])), "<i2")
    assert data.tolist() == [0, 16384, 32767, -32767, 32767, -32767]


@pytest.mark.parametrize("fmt, subtype", [("wav", "PCM_16"), ("wav-float", "FLOAT"),
                                          ("flac", "PCM_16")])
def test_write_audio_formats(tmp_path, fmt, subtype):
    audio = 0.3 * torch.sin(torch.arange(4800) / 10.0)
    path = write_audio(tmp_path / f"a{FORMATS[fmt][2]}", audio, 24000, fmt)
    info = sf.info(str(path))
    assert (info.samplerate, info.channels, info.frames, info.subtype) == (24000, 1, 4800, subtype)
    back, _ = sf.read(str(path), dtype="float32")
    tol = 1e-7 if fmt == "wav-float" else 1 / 32767
    assert np.abs(back - audio.numpy()).max() <= tol


def test_resample_length():
    audio = torch.randn(24000)
    assert resample(audio, 24000, 16000).shape[0] == 16000
    assert resample(audio, 24000, 24000) is audio


def test_codes_roundtrip(tmp_path):
    pieces = [torch.randint(0, 128, (8, 9)), torch.randint(0, 128, (8, 3))]
    path = mio.save_codes(tmp_path / "x.codes.safetensors", pieces, {"pause_frames": 8})
    back, meta = mio.load_codes(path)
    assert meta == {"pause_frames": 8}
    assert all(torch.equal(a, b) for a, b in zip(pieces, back, strict=True))


def test_load_codes_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        mio.load_codes(tmp_path / "none.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(InputError, match="unreadable"):
        mio.load_codes(bad)


def test_read_audio_checks(tmp_path):
    stereo = np.stack([np.full(100, 0.1), np.full(100, -0.1)], axis=1).astype("float32")
    sf.write(str(tmp_path / "ok.wav"), stereo, 16000, subtype="FLOAT")
    audio, rate = read_audio(tmp_path / "ok.wav")
    assert (tuple(audio.shape), rate) == ((2, 100), 16000)
    sf.write(str(tmp_path / "nan.wav"), np.array([0.0, math.nan], "float32"), 16000,
             subtype="FLOAT")
    with pytest.raises(InputError, match="NaN"):
        read_audio(tmp_path / "nan.wav")
    sf.write(str(tmp_path / "empty.wav"), np.zeros(0, "float32"), 16000)
    with pytest.raises(InputError, match="no samples"):
        read_audio(tmp_path / "empty.wav")
    (tmp_path / "junk.wav").write_bytes(b"not audio at all")
    with pytest.raises(InputError, match="unreadable"):
        read_audio(tmp_path / "junk.wav")
    with pytest.raises(InputError, match="not found"):
        read_audio(tmp_path / "missing.wav")


def test_raw_sink_writes_pcm():
    buffer = io.BytesIO()
    outputs.RawPcmSink(buffer).on_chunk(torch.tensor([0.5, -0.5]))
    assert np.frombuffer(buffer.getvalue(), "<i2").tolist() == [16384, -16384]


# --- manifest and output directory --------------------------------------------------------------


def test_manifest_last_line_wins_and_truncated_line_is_repaired(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [{"id": "a", "status": "error"}, {"id": "b", "status": "ok"},
             {"id": "a", "status": "ok"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"id": "c", "sta')
    manifest = outputs.Manifest(path)
    assert manifest.get("a")["status"] == "ok" and manifest.get("c") is None
    rewritten = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["id"] for r in rewritten] == ["a", "b"]
    manifest.add({"id": "c", "status": "ok"})
    manifest.add({"id": "b", "status": "error"})
    final = [json.loads(x) for x in path.read_text().splitlines()]
    assert {r["id"]: r["status"] for r in final} == {"a": "ok", "b": "error", "c": "ok"}
    assert len(final) == 3


def test_output_dir_lock_refuses_a_second_run(tmp_path):
    with outputs.DirectorySink(tmp_path, "tts_sft") as first:
        assert first.dir == tmp_path / "tts_sft"
        with pytest.raises(OutputError, match="another mimo-tts run"):
            outputs.DirectorySink(tmp_path, "tts_sft").open()
    with outputs.DirectorySink(tmp_path, "tts_sft"):  # released on exit
        pass


def test_output_dir_cleans_temps_and_checks_done(tmp_path):
    task_dir = tmp_path / "tts_sft"
    task_dir.mkdir()
    (task_dir / f"{TEMP_MARK}99-x.wav").write_bytes(b"partial")
    with outputs.DirectorySink(tmp_path, "tts_sft", "flac") as out:
        assert not list(task_dir.glob(f"{TEMP_MARK}*"))
        assert out.audio_path("x").name == "x.flac"
        assert out.done_record("x", "k1") is None
        write_json(out.sidecar_path("x"), {"result": {"key": "k1", "status": "ok"}})
        assert out.done_record("x", "k1") is None  # no audio yet: not done
        out.audio_path("x").write_bytes(b"audio")
        assert out.done_record("x", "k1") == {"key": "k1", "status": "ok"}
        assert out.done_record("x", "k2") is None


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="cannot create output directory"):
        outputs.DirectorySink(blocker, "tts_sft").open()
