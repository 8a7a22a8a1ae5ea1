"""Output failures: unwritable places, a full disk (a real RLIMIT_FSIZE limit, /dev/full),
device targets, a closed stdout pipe and two runs into one directory. Exit 5, nothing partial."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import time

import pytest
import soundfile as sf

from mimo_tts.errors import EXIT_IO
from mimo_tts.runtime.paths import TEMP_MARK
from tests.helpers import audio_files, error_line, read_lines, temp_files

TINY = ("synth", "--model", "tiny", "--max-new-groups", "3")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory(invoke, tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        result = invoke(*TINY, "--text", "hi", "--output-dir", locked)
    finally:
        locked.chmod(stat.S_IRWXU)
    assert result.exit_code == EXIT_IO
    assert "cannot create output directory" in error_line(result.stderr)


@pytest.mark.slow
def test_disk_full_fails_items_cleanly_and_a_rerun_completes(limited, mimo, tmp_path):
    """RLIMIT_FSIZE (16 KiB per file): each 23 KiB wav fails to write with EFBIG."""
    lines = tmp_path / "lines.txt"
    lines.write_text("First one.\nSecond one.\nThird one.\n")
    args = (*TINY, "--input", lines, "--json")
    proc = limited(*args, limits={resource.RLIMIT_FSIZE: 16 * 1024})
    assert proc.returncode == EXIT_IO, proc.stderr.decode()
    records = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [r["status"] for r in records] == ["error"] * 3
    assert all("File too large" in r["error"] and r["exit_code"] == EXIT_IO for r in records)
    task_dir = tmp_path / "output_audio" / "tts_sft"
    names = {p.name for p in task_dir.iterdir()}
    assert names == {"results.jsonl", ".mimo-tts.lock"}  # no wav, no sidecar, no temp file
    assert [r["status"] for r in read_lines(task_dir / "results.jsonl")] == ["error"] * 3
    rerun = mimo(*args)
    assert rerun.returncode == 0, rerun.stderr.decode()
    assert [json.loads(x)["status"] for x in rerun.stdout.decode().splitlines()] == ["ok"] * 3
    assert len(audio_files(task_dir)) == 3 and not temp_files(task_dir)


def test_dev_full_is_no_space_and_dev_null_stays_a_device(invoke):
    full = invoke(*TINY, "--text", "hi", "-o", "/dev/full", "--json")
    assert full.exit_code == EXIT_IO
    assert "No space left on device" in json.loads(full.stdout)["error"]
    null = invoke(*TINY, "--text", "hi", "-o", "/dev/null", "--json")  # no --overwrite needed
    assert null.exit_code == 0, null.stderr
    assert json.loads(null.stdout)["path"] == "/dev/null"
    for device in ("/dev/null", "/dev/full"):
        assert stat.S_ISCHR(os.stat(device).st_mode)  # written into, never replaced
    assert not [p for p in os.listdir("/dev") if p.startswith(TEMP_MARK)]


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--raw", "--stream"],  # chunks as decoded
    ["-o", "-"],  # the encoded file, bigger than the pipe: a short write (issue 13 B)
], ids=["raw-stream", "stdout-file"])
def test_closed_stdout_pipe_is_an_io_error(base_env, entry_point, tmp_path, args):
    """`... | head -c 100`: the reader goes away; exit 5, one error line, no traceback."""
    proc = subprocess.Popen([str(entry_point), *TINY[:3], "--text", "Piped away.", *args,
                             "--max-new-groups", "40"],
                            cwd=tmp_path, env=base_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == EXIT_IO, stderr
    assert "broken pipe" in stderr and "Traceback" not in stderr
    assert "Exception ignored" not in stderr


@pytest.mark.slow
def test_two_runs_into_one_directory(base_env, entry_point, invoke, tmp_path, manifest):
    """A second run (another process) is refused while the first holds the directory lock."""
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Line number {i}.\n" for i in range(6)))
    first = subprocess.Popen([str(entry_point), *TINY, "--input", str(lines)], cwd=tmp_path,
                             env=base_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL)
    lock = tmp_path / "output_audio" / "tts_sft" / ".mimo-tts.lock"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (lock.is_file() and lock.read_text().strip()):
        time.sleep(0.02)
    second = invoke(*TINY, "--input", lines)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()
    assert second.exit_code == EXIT_IO
    assert f"another mimo-tts run (pid {first.pid})" in error_line(second.stderr)
    task_dir = lock.parent
    assert len(manifest(task_dir)) == 6 and len(audio_files(task_dir)) == 6
    for wav in audio_files(task_dir):
        assert sf.info(str(wav)).frames == 960 * 4 * 3
