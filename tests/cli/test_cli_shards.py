"""Three shards of 12 items in one output folder, run at once as real processes: one killed with
SIGKILL mid-run and resumed. Each item lands exactly once, `mimo-tts status` reports the gap
(exit 10) and then the whole (exit 0), `--merge` writes one line per item (issue 15)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter

import pytest

from mimo_tts.batch.items import read_items
from mimo_tts.batch.shards import shard_of
from mimo_tts.errors import EXIT_INCOMPLETE


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []


@pytest.mark.slow
def test_three_shards_one_killed_and_resumed_write_each_item_once(base_env, entry_point,
                                                                 tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Sentence number {i} of the batch.\n" for i in range(12)))
    ids = [item.id for item in read_items([], [str(lines)])]
    owned = {k: [i for i in ids if shard_of(i, 3) == k] for k in (1, 2, 3)}
    victim = max(owned, key=lambda k: len(owned[k]))
    folder = tmp_path / "out" / "tts_sft"

    def synth(k: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(entry_point), "synth", "--model", "tiny", "--input", str(lines), "--output-dir",
             "out", "--max-new-groups", "6", "--shard", f"{k}/3", *extra], cwd=tmp_path,
            env=base_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)

    procs = {k: synth(k) for k in (1, 2, 3)}
    manifest = folder / f"results.shard-{victim}-of-3.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not _lines(manifest):
        time.sleep(0.01)
    procs[victim].send_signal(signal.SIGKILL)
    killed_after = len(_lines(manifest))
    for k, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == (-signal.SIGKILL if k == victim else 0), err.decode()
    assert 1 <= killed_after < len(owned[victim]), "the shard must be killed mid-run"

    status = subprocess.run([str(entry_point), "status", "out", "--input", str(lines), "--json"],
                            cwd=tmp_path, env=base_env, capture_output=True)
    assert status.returncode == EXIT_INCOMPLETE, status.stderr.decode()
    report = json.loads(status.stdout)
    missing = {e["id"] for e in report["missing"]}
    assert report["items"] == 12 and report["done"] == 12 - len(missing) and not report["failed"]
    assert missing and missing <= set(owned[victim])  # only the killed shard has a gap
    assert {e["shard"] for e in report["missing"]} == {f"{victim}/3"}
    assert report["shards"][f"{victim}/3"]["missing"] == len(missing)
    text = subprocess.run([str(entry_point), "status", "out", "--input", str(lines)],
                          cwd=tmp_path, env=base_env, capture_output=True, text=True)
    assert text.returncode == EXIT_INCOMPLETE
    assert f"12 items: {12 - len(missing)} done, 0 failed, {len(missing)} missing" in text.stdout
    assert f"shard {victim}/3: {len(owned[victim]) - len(missing)} done, 0 failed, " \
           f"{len(missing)} missing" in text.stdout
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.wav")}

    resumed = synth(victim)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()
    assert f"{len(missing)} written, {len(owned[victim]) - len(missing)} skipped" in err.decode()
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("*.wav")}
    assert len(after) == 12 and all(after[name] == t for name, t in before.items())  # kept
    per_manifest = {k: [json.loads(x)["id"] for x in
                        _lines(folder / f"results.shard-{k}-of-3.jsonl")] for k in (1, 2, 3)}
    assert {k: sorted(v) for k, v in per_manifest.items()} == {
        k: sorted(v) for k, v in owned.items()}
    assert Counter(sum(per_manifest.values(), [])) == Counter(ids)  # each item exactly once

    merged = subprocess.run([str(entry_point), "status", "out", "--input", str(lines),
                             "--merge"], cwd=tmp_path, env=base_env, capture_output=True,
                            text=True)
    assert merged.returncode == 0, merged.stderr
    assert "12 items: 12 done, 0 failed, 0 missing" in merged.stdout
    records = [json.loads(x) for x in _lines(folder / "results.jsonl")]
    assert [r["id"] for r in records] == ids and {r["status"] for r in records} == {"ok"}


@pytest.mark.slow
def test_status_counts_failed_items_with_their_exit_codes(mimo, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"id": "good", "text": "Fine."}\n{"id": "bad", "text": ""}\n')
    run = mimo("synth", "--model", "tiny", "--input", batch, "--max-new-groups", "2")
    assert run.returncode == 8, run.stderr  # partial
    status = mimo("status", "output_audio", "--json")
    report = json.loads(status.stdout)
    assert status.returncode == EXIT_INCOMPLETE
    assert report["done"] == 1 and [(e["id"], e["exit_code"]) for e in report["failed"]] == [
        ("bad", 9)]
    assert b"failed bad (exit 9):" in mimo("status", "output_audio/tts_sft").stdout
    missing = mimo("status", tmp_path / "nowhere")
    assert missing.returncode == 5 and missing.stderr.startswith(b"Error: no manifest")
