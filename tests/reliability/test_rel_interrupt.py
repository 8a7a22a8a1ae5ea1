"""Interruption with real signals on real processes: SIGTERM while streaming, and SIGINT /
kill -9 in the middle of an atomic write. (Ctrl-C and kill -9 of a whole batch, then the resume:
tests/cli/test_cli_errors.py::test_interrupt_keeps_complete_outputs_and_resumes.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import soundfile as sf

from mimo_tts.errors import EXIT_INTERRUPTED
from tests.helpers import audio_files, read_lines, temp_files

# A process stopped inside `atomic_write`, after part of the file went to disk.
WRITER = """
import sys, time
from mimo_tts.runtime.paths import atomic_write

def writer(handle):
    handle.write(b"partial audio bytes")
    handle.flush()
    print("writing", flush=True)
    time.sleep(120)

atomic_write(sys.argv[1], writer)
"""


def _stopped_mid_write(target, sig, env):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"writing\n"
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    return proc.returncode


def test_kill_9_mid_write_leaves_a_temp_file_the_next_run_cleans(base_env, invoke, tmp_path):
    task_dir = tmp_path / "output_audio" / "tts_sft"
    task_dir.mkdir(parents=True)
    assert _stopped_mid_write(task_dir / "x.wav", signal.SIGKILL, base_env) == -signal.SIGKILL
    (left,) = temp_files(task_dir)
    assert left.read_bytes() == b"partial audio bytes" and not (task_dir / "x.wav").exists()
    result = invoke("synth", "--model", "tiny", "--text", "Next run.", "--max-new-groups", "1")
    assert result.exit_code == 0, result.stderr
    assert not temp_files(task_dir) and len(audio_files(task_dir)) == 1


def test_ctrl_c_mid_write_removes_the_partial_file(base_env, tmp_path):
    target = tmp_path / "keep.wav"
    target.write_bytes(b"the previous complete file")
    code = _stopped_mid_write(target, signal.SIGINT, base_env)
    assert code != 0
    assert not temp_files(tmp_path)
    assert target.read_bytes() == b"the previous complete file"


@pytest.mark.slow
def test_sigterm_while_streaming_stops_cleanly_and_resumes(base_env, entry_point, tmp_path,
                                                           manifest):
    """SIGTERM with the Stage-1 worker thread running: exit 130, complete files only, resume."""
    n = 6
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Streamed sentence {i}.\n" for i in range(n)))
    args = [str(entry_point), "synth", "--model", "tiny", "--input", str(lines), "--stream",
            "--max-new-groups", "6"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=base_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    task_dir = tmp_path / "output_audio" / "tts_sft"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(audio_files(task_dir)) < 2:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, stderr.decode()
    assert "re-run the same command to resume" in stderr.decode()
    assert not temp_files(task_dir)
    done = {p.stem for p in audio_files(task_dir)}
    assert 2 <= len(done) < n
    for wav in audio_files(task_dir):
        assert sf.info(str(wav)).frames == 960 * 4 * 6
    ok = {r["id"] for r in read_lines(task_dir / "results.jsonl") if r["status"] == "ok"}
    assert ok <= done  # every manifest line parses; none names a missing file
    rerun = subprocess.run([*args, "--json"], cwd=tmp_path, env=base_env, capture_output=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()
    statuses = [json.loads(x)["status"] for x in rerun.stdout.decode().splitlines()]
    assert statuses.count("skipped") == len(done) and statuses.count("ok") == n - len(done)
    assert len(manifest(task_dir)) == n and len(audio_files(task_dir)) == n
