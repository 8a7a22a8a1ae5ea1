"""Output targets (issue 13, output side): `--raw` alone, data lines with stderr on a terminal,
the format from the `-o` extension, several formats in one folder, `-q`, a terminal as `-o -`,
re-runs of `-o FILE`, `decode --overwrite`, missing folders, JSON for run-level errors, short
writes to a closed pipe, sidecars never replaced, symlinks planted in the output folder, the
manifest, and what `kill -9` leaves behind. Real CLI runs (in-process or subprocesses), tiny
preset, real files."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from mimo_tts.errors import EXIT_CHECKPOINT, EXIT_DEVICE, EXIT_IO, EXIT_USAGE
from mimo_tts.presets import ensure_tiny_preset, tiny_preset_dir
from mimo_tts.runtime.paths import CACHE_ENV

TINY = ("synth", "--model", "tiny", "--max-new-groups", "3")
FRAMES = 960 * 4 * 3  # 3 groups of 4 frames of 960 samples


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _drain(fd: int) -> bytes:
    """Everything written to a pty until its other end is closed."""
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the writer side is closed
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


# --- 1 / A: --raw alone -----------------------------------------------------------------------


def test_a_raw_without_stream_writes_each_items_pcm(invoke, tmp_path):
    raw = invoke(*TINY, "--text", "Raw alone.", "--text", "And again.", "--raw")
    assert raw.exit_code == 0, raw.stderr
    for i, text in enumerate(("Raw alone.", "And again.")):
        ref = invoke(*TINY, "--text", text, "-o", tmp_path / f"ref{i}.wav")
        assert ref.exit_code == 0, ref.stderr
    pcm = b"".join(sf.read(str(tmp_path / f"ref{i}.wav"), dtype="int16")[0].astype("<i2")
                   .tobytes() for i in range(2))
    assert len(pcm) == 2 * 2 * FRAMES and raw.stdout_bytes == pcm


# --- 2: data lines on stdout while the bar is on a terminal -------------------------------------


@pytest.mark.slow
def test_2_paths_go_to_stdout_while_the_bar_is_on_a_terminal(base_env, entry_point, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("One line.\nTwo lines.\nThree lines.\n")
    master, slave = os.openpty()
    with open(tmp_path / "paths.txt", "wb") as out:
        proc = subprocess.Popen([str(entry_point), *TINY, "--input", str(lines)], cwd=tmp_path,
                                env={**base_env, "TERM": "xterm"}, stdout=out, stderr=slave,
                                stdin=subprocess.DEVNULL)
    os.close(slave)
    screen = _drain(master)
    os.close(master)
    assert proc.wait(timeout=300) == 0, screen.decode(errors="replace")
    paths = (tmp_path / "paths.txt").read_text().splitlines()
    assert len(paths) == 3 and all((tmp_path / p).is_file() for p in paths)
    assert b"output_audio/" not in screen and b"3 written" in screen
    # the bar: items done, the time elapsed and the time left (before: no time left)
    assert re.search(rb"[0-3]/3 \S* ?\d:\d\d:\d\d (\d:\d\d:\d\d|-:--:--)", screen), screen


@pytest.mark.slow
def test_2_one_long_text_shows_its_pieces_and_the_time_left_on_a_terminal(base_env, entry_point,
                                                                          tmp_path):
    """One --text of 25 sentences is several pieces: the bar counts them, with the time left
    (before: one item, so no bar until the end)."""
    from mimo_tts.synthesis.captions import text_pieces
    from mimo_tts.synthesis.options import SynthesisOptions

    text = " ".join(f"Sentence number {n} of the long text is read here." for n in range(1, 26))
    count = len(text_pieces(text, SynthesisOptions()))
    assert count > 2
    master, slave = os.openpty()
    proc = subprocess.Popen([str(entry_point), *TINY, "--text", text], cwd=tmp_path,
                            env={**base_env, "TERM": "xterm"}, stdout=subprocess.DEVNULL,
                            stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    screen = _drain(master)
    os.close(master)
    assert proc.wait(timeout=300) == 0, screen.decode(errors="replace")
    assert b"1 written" in screen
    shown = re.findall(rb"(\d+)/%d \S* ?\d:\d\d:\d\d (?:\d:\d\d:\d\d|-:--:--)" % count, screen)
    assert shown and {int(n) for n in shown} - {0, count}, screen  # pieces done on the way


# --- 4: the format follows the -o extension -------------------------------------------------------


@pytest.mark.parametrize(("name", "fmt", "container", "subtype", "sidecar"), [
    ("x.wav", "wav", "WAV", "PCM_16", "x.json"),
    ("x.flac", "flac", "FLAC", "PCM_16", "x.json"),  # as -o x.wav (before: x.flac.json)
    ("x.mp3", "mp3", "MP3", "MPEG_LAYER_III", "x.json"),
    ("x.opus", "opus", "OGG", "OPUS", "x.json"),
    ("x.ogg", "ogg", "OGG", "VORBIS", "x.json"),
    ("X.FLAC", "flac", "FLAC", "PCM_16", "X.json")])
def test_4_output_format_follows_the_extension(invoke, tmp_path, name, fmt, container, subtype,
                                               sidecar):
    """`-o FILE` in any format has its sidecar `FILE`'s stem + `.json`, as `-o one.wav` has
    `one.json` (`-o one.flac` wrote `one.flac.json`); so have its captions."""
    result = invoke(*TINY, "--text", "Format by name.", "-o", tmp_path / name, "--json",
                    "--captions", "srt")
    assert result.exit_code == 0, result.stderr
    info = sf.info(str(tmp_path / name))
    assert (info.format, info.subtype, info.samplerate) == (container, subtype, 24000)
    audio, _ = sf.read(str(tmp_path / name), dtype="float32")
    assert abs(len(audio) - FRAMES) < 2400 and np.abs(audio).max() > 0.01  # codec padding
    assert json.loads((tmp_path / sidecar).read_text())["audio"]["format"] == fmt
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [name, sidecar, sidecar.replace(".json", ".srt")])


def test_4_format_flag_against_the_extension_and_rates(invoke, tmp_path):
    clash = invoke(*TINY, "--text", "Clash.", "-o", tmp_path / "x.mp3", "--format", "flac")
    assert clash.exit_code == EXIT_USAGE and "x.mp3" in clash.stderr and "flac" in clash.stderr
    unknown = invoke(*TINY, "--text", "Unknown.", "-o", tmp_path / "x.audio")
    assert unknown.exit_code == EXIT_USAGE and ".audio" in unknown.stderr
    rate = invoke(*TINY, "--text", "Rate.", "-o", tmp_path / "x.opus", "--sample-rate", "44100")
    assert rate.exit_code == EXIT_USAGE and "opus" in rate.stderr and "48000" in rate.stderr
    assert not [p for p in tmp_path.iterdir() if p.is_file()]
    agree = invoke(*TINY, "--text", "Agree.", "-o", tmp_path / "f.wav", "--format", "wav-float")
    assert agree.exit_code == 0 and sf.info(str(tmp_path / "f.wav")).subtype == "FLOAT"
    named = invoke(*TINY, "--text", "Named.", "-o", tmp_path / "n.audio", "--format", "mp3")
    assert named.exit_code == 0 and sf.info(str(tmp_path / "n.audio")).format == "MP3"
    folder = invoke(*TINY, "--text", "Folder.", "--format", "opus", "--json")
    assert folder.exit_code == 0, folder.stderr
    path = tmp_path / json.loads(folder.stdout)["path"]
    assert path.suffix == ".opus" and sf.info(str(path)).subtype == "OPUS"


def test_4_decode_follows_the_extension(invoke, tmp_path):
    made = invoke(*TINY, "--text", "Decode me.", "--save-codes", "--json")
    codes = tmp_path / json.loads(made.stdout)["codes_path"]
    out = invoke("decode", codes, "--tokenizer", "tiny", "-o", tmp_path / "d.flac")
    assert out.exit_code == 0, out.stderr
    assert sf.info(str(tmp_path / "d.flac")).format == "FLAC"
    clash = invoke("decode", codes, "--tokenizer", "tiny", "-o", tmp_path / "d.mp3",
                   "--format", "wav")
    assert clash.exit_code == EXIT_USAGE and not (tmp_path / "d.mp3").exists()


# --- 5: formats in one output folder -------------------------------------------------------------


def test_5_formats_in_one_folder_keep_their_own_files(invoke, tmp_path, manifest):
    # one id given in the lines: derived ids would differ by seed (another seed, another file)
    seeded, plain = tmp_path / "seeded.jsonl", tmp_path / "plain.jsonl"
    seeded.write_text('{"id": "Seed_test", "text": "Seed test", "seed": 5}\n')
    plain.write_text('{"id": "Seed_test", "text": "Seed test"}\n')
    wav = invoke(*TINY, "--input", seeded, "--save-codes", "--json")
    flac = invoke(*TINY, "--input", plain, "--format", "flac", "--save-codes", "--json")
    assert wav.exit_code == flac.exit_code == 0, (wav.stderr, flac.stderr)
    first, second = json.loads(wav.stdout), json.loads(flac.stdout)
    assert Path(first["path"]).suffix == ".wav" and Path(second["path"]).suffix == ".flac"
    assert first["codes_path"] != second["codes_path"]
    task_dir = tmp_path / "output_audio" / "tts_sft"
    stem = Path(first["path"]).stem
    wav_side = json.loads((task_dir / f"{stem}.json").read_text())
    flac_side = json.loads((task_dir / f"{stem}.flac.json").read_text())
    assert (wav_side["seed"], wav_side["audio"]["format"]) == (5, "wav")
    assert (flac_side["seed"], flac_side["audio"]["format"]) == (0, "flac")
    lines = manifest(task_dir)
    assert sorted((r["path"], r["status"]) for r in lines) == sorted(
        [(first["path"], "ok"), (second["path"], "ok")])
    for args in (("--input", seeded), ("--input", plain, "--format", "flac")):
        again = invoke(*TINY, *args, "--save-codes", "--json")
        assert again.exit_code == 0, again.stderr
        assert json.loads(again.stdout)["status"] == "skipped"
    assert len(manifest(task_dir)) == 2


# --- 10: -q, -o - to a terminal, vLLM's logs, re-runs, decode, folders, --json errors ----------


def test_10_quiet_keeps_the_data_on_stdout(invoke, tmp_path):
    result = invoke(*TINY, "--text", "Quiet please.", "-q", "--save-codes")
    assert result.exit_code == 0 and result.stderr == ""
    (path,) = result.stdout.splitlines()
    assert (tmp_path / path).is_file()
    codes = (tmp_path / path).with_suffix(".codes.safetensors")
    decoded = invoke("decode", codes, "--tokenizer", "tiny", "-q")
    assert decoded.exit_code == 0 and decoded.stderr == ""
    assert Path(decoded.stdout.strip()).is_file()


@pytest.mark.parametrize("flags", [("-o", "-"), ("--raw",)])
def test_10_binary_to_a_terminal_is_refused(base_env, entry_point, tmp_path, flags):
    master, slave = os.openpty()
    proc = subprocess.Popen([str(entry_point), *TINY, "--text", "Not on screen.", *flags],
                            cwd=tmp_path, env=base_env, stdout=slave, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    screen = _drain(master)
    os.close(master)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == EXIT_USAGE, stderr
    assert screen == b"" and "terminal" in stderr


def test_10_quiet_cuts_the_libraries_to_errors(invoke, monkeypatch):
    """Without vLLM installed the run ends with exit 2, after -q has set vLLM's and torch's log
    levels (before any import); a level the user set stays. (With vLLM installed:
    tests/vllm/test_vllm_cli.py::test_vllm_quiet_leaves_stderr_empty.)"""
    names = ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "TORCH_LOGS", "TQDM_DISABLE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    loud = invoke(*TINY, "--text", "hi", "--engine", "vllm")
    assert loud.exit_code == EXIT_USAGE and not any(name in os.environ for name in names[1:])
    assert os.environ.get("VLLM_LOGGING_LEVEL") in (None, "WARNING")  # the engine's default
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # a fresh process has none
    result = invoke(*TINY, "--text", "hi", "--engine", "vllm", "-q")
    assert result.exit_code == EXIT_USAGE and "vLLM" in result.stderr
    assert [os.environ.get(n) for n in names] == ["ERROR", "ERROR", "-torch", "1"]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    invoke(*TINY, "--text", "hi", "--engine", "vllm", "-q")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_10_rerun_of_output_file_is_skipped(invoke, tmp_path):
    target = tmp_path / "hello.wav"
    first = invoke(*TINY, "--text", "One file.", "-o", target)
    assert first.exit_code == 0, first.stderr
    before = target.read_bytes(), target.stat().st_mtime_ns
    again = invoke(*TINY, "--text", "One file.", "-o", target, "--json")
    assert again.exit_code == 0, again.stderr
    record = json.loads(again.stdout)
    assert record["status"] == "skipped" and record["path"] == str(target)
    assert (target.read_bytes(), target.stat().st_mtime_ns) == before
    other = invoke(*TINY, "--text", "Other words.", "-o", target)
    assert other.exit_code == EXIT_IO and "--overwrite" in other.stderr
    assert target.read_bytes() == before[0]


def test_10_decode_keeps_an_existing_file_without_overwrite(invoke, tmp_path):
    made = invoke(*TINY, "--text", "Decode over.", "--save-codes", "--json")
    codes = tmp_path / json.loads(made.stdout)["codes_path"]
    target = tmp_path / "item.wav"
    target.write_bytes(b"precious")
    kept = invoke("decode", codes, "--tokenizer", "tiny", "-o", target)
    assert kept.exit_code == EXIT_IO and "--overwrite" in kept.stderr
    assert target.read_bytes() == b"precious"
    replaced = invoke("decode", codes, "--tokenizer", "tiny", "-o", target, "--overwrite")
    assert replaced.exit_code == 0 and target.read_bytes()[:4] == b"RIFF"


def test_10_output_file_creates_its_folder(invoke, tmp_path):
    target = tmp_path / "newdir" / "deeper" / "x.wav"
    result = invoke(*TINY, "--text", "New folder.", "-o", target)
    assert result.exit_code == 0, result.stderr
    assert sf.info(str(target)).frames == FRAMES and target.with_suffix(".json").is_file()
    (tmp_path / "file").write_text("not a folder")
    blocked = invoke(*TINY, "--text", "Blocked.", "-o", tmp_path / "file" / "x.wav")
    assert blocked.exit_code == EXIT_IO
    assert "cannot create" in blocked.stderr and ".json" not in blocked.stderr


@pytest.mark.parametrize(("args", "code"), [
    (("synth", "--model", "/nonexistent/lm", "--text", "hi"), EXIT_CHECKPOINT),
    (("synth", "--model", "tiny", "--task", "bogus", "--text", "hi"), EXIT_USAGE),
    (("synth", "--model", "tiny", "--lm-device", "gpu", "--text", "hi"), EXIT_DEVICE)])
def test_10_json_run_level_errors_are_one_json_object(invoke, args, code):
    result = invoke(*args, "--json")
    assert result.exit_code == code
    (line,) = result.stdout.splitlines()
    record = json.loads(line)
    assert record["status"] == "error" and record["exit_code"] == code
    assert record["error"] in result.stderr


# --- B: a short write to a closed stdout: in test_rel_outputs.py (closed_stdout_pipe) -------

# --- C: sidecars and codes beside -o FILE are never replaced ----------------------------------


@pytest.mark.parametrize("name", ["mine.json", "mine.codes.safetensors"])
def test_c_output_file_keeps_a_foreign_sidecar(invoke, tmp_path, name):
    foreign = tmp_path / name
    foreign.write_bytes(b"someone else's file")
    result = invoke(*TINY, "--text", "Beside.", "-o", tmp_path / "mine.wav", "--save-codes")
    assert result.exit_code == EXIT_IO and name in result.stderr and "--overwrite" in result.stderr
    assert foreign.read_bytes() == b"someone else's file"
    assert not (tmp_path / "mine.wav").exists()
    forced = invoke(*TINY, "--text", "Beside.", "-o", tmp_path / "mine.wav", "--save-codes",
                    "--overwrite")
    assert forced.exit_code == 0 and foreign.read_bytes() != b"someone else's file"


# --- E: symlinks planted in the output folder --------------------------------------------------


@pytest.mark.parametrize("name", [".mimo-tts.lock", "results.jsonl"])
def test_e_symlinks_in_the_output_folder_change_nothing_outside(invoke, tmp_path, name):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me\n")
    task_dir = tmp_path / "out" / "tts_sft"
    task_dir.mkdir(parents=True)
    (task_dir / name).symlink_to(outside)
    result = invoke(*TINY, "--text", "Linked.", "--output-dir", tmp_path / "out")
    assert result.exit_code == EXIT_IO and "symbolic link" in result.stderr, result.stderr
    assert outside.read_bytes() == b"keep me\n"


def test_e_a_symlinked_temp_name_changes_nothing_outside(invoke, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me\n")
    target = tmp_path / "x.wav"
    for name in ("x.wav", "x.json"):  # this process's temp names (the run is in-process)
        (tmp_path / f".mimo-tmp-{os.getpid()}-{name}.part").symlink_to(outside)
    result = invoke(*TINY, "--text", "Temp link.", "-o", target)
    assert result.exit_code == 0, result.stderr
    assert outside.read_bytes() == b"keep me\n" and sf.info(str(target)).frames == FRAMES


# --- K: the manifest ----------------------------------------------------------------------------


def test_k_manifest_that_is_a_directory_is_exit_5(invoke, tmp_path):
    (tmp_path / "output_audio" / "tts_sft" / "results.jsonl").mkdir(parents=True)
    result = invoke(*TINY, "--text", "Manifest dir.")
    assert result.exit_code == EXIT_IO and "results.jsonl" in result.stderr, result.stderr
    assert "unexpected" not in result.stderr


def test_k_a_refused_item_keeps_the_ok_line_of_the_kept_output(invoke, tmp_path, manifest):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"id": "a", "text": "One."}\n')
    second.write_text('{"id": "a", "text": "Two."}\n')
    assert invoke(*TINY, "--input", first).exit_code == 0
    refused = invoke(*TINY, "--input", second)
    assert refused.exit_code == EXIT_IO and "exists from other inputs" in refused.stderr
    (line,) = manifest(tmp_path / "output_audio" / "tts_sft")
    assert (line["status"], line["text"]) == ("ok", "One.")


# --- L: what kill -9 leaves behind ----------------------------------------------------------------


def test_l_stale_temps_beside_an_output_file_are_removed(invoke, tmp_path):
    dead, alive = _dead_pid(), os.getppid()
    stale = [tmp_path / f".mimo-tmp-{dead}-x.wav.part", tmp_path / f".mimo-tmp-{dead}-x.json.part"]
    live = tmp_path / f".mimo-tmp-{alive}-x.wav.part"
    for path in (*stale, live):
        path.write_bytes(b"partial")
    result = invoke(*TINY, "--text", "Clean up.", "-o", tmp_path / "x.wav")
    assert result.exit_code == 0, result.stderr
    assert not any(p.exists() for p in stale) and live.read_bytes() == b"partial"


def test_l_half_built_preset_folders_are_removed(tmp_path):

    env = {CACHE_ENV: str(tmp_path)}
    final = tiny_preset_dir(env)
    stale = final.with_name(f"{final.name}.tmp-{_dead_pid()}")
    (stale / "lm").mkdir(parents=True)
    (stale / "lm" / "model.safetensors").write_bytes(b"half")
    live = final.with_name(f"{final.name}.tmp-{os.getppid()}")
    live.mkdir()
    lm, tok = ensure_tiny_preset(env)
    assert (lm / "model.safetensors").is_file() and (final / "complete").is_file()
    assert not stale.exists() and live.is_dir()
