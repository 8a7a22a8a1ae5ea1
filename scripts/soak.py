"""Soak test: a long tiny-model batch with random faults, then a check that nothing was lost.

Writes a `.jsonl` batch of N items (default 200) for `tts_sft_with_audio` in which some lines
are bad (malformed JSON, empty text, control characters, unknown fields, duplicate ids,
invalid UTF-8, bad seeds) and some voice prompts are bad (NaN samples, junk bytes, no samples,
missing). Runs the same `mimo-tts synth` command repeatedly, killing it at random moments
(kill -9, Ctrl-C, SIGTERM, during loading or mid-batch) and once starting a second run into the
same directory while the first holds it, then lets a last run finish. Checks at the end that
every good item has exactly one valid wav and one `ok` manifest line whose key matches its
sidecar, every bad item one `error` line and no file, and that no temp file remains. Prints
the counts as JSON; exits 1 when a check fails.

    .venv/bin/python scripts/soak.py [--items 200] [--faults 6] [--seed 0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

ENTRY_POINT = Path(sys.executable).with_name("mimo-tts")
TASK = "tts_sft_with_audio"
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
BAD_LINES = ("malformed", "empty", "control", "unknown_field", "duplicate", "utf8", "seed")
BAD_AUDIO = ("nan.wav", "junk.wav", "empty.wav", "missing.wav")
FAULTS = ("kill9", "kill9-early", "sigint", "sigterm")


def write_voices(root: Path) -> None:
    t = np.arange(8000) / 16000
    sf.write(str(root / "good.wav"), (0.3 * np.sin(2 * np.pi * 220 * t)).astype("float32"), 16000)
    nan = np.full(800, 0.1, "float32")
    nan[3] = np.nan
    sf.write(str(root / "nan.wav"), nan, 16000, subtype="FLOAT")
    (root / "junk.wav").write_bytes(b"this is not audio")
    sf.write(str(root / "empty.wav"), np.zeros((0, 1), "float32"), 16000)


def bad_line(kind: str, i: int, rng: random.Random, good_ids: list[str]) -> bytes:
    text = " ".join(rng.choices(WORDS, k=3)) + "."
    record = {"id": f"bad-{i:03d}", "text": text, "prompt_audio": "good.wav"}
    if kind == "malformed":
        return b'{"id": "broken", "text": '
    if kind == "utf8":
        return b'{"id": "latin-%d", "text": "caf\xe9"}' % i
    if kind == "empty":
        record["text"] = "   "
    elif kind == "control":
        record["text"] = "bell\u0007" + text
    elif kind == "unknown_field":
        record["speaker"] = "bob"
    elif kind == "duplicate":
        record["id"] = rng.choice(good_ids) if good_ids else "dup"
    elif kind == "seed":
        record["seed"] = "seven"
    return json.dumps(record).encode()


def write_batch(root: Path, n: int, rng: random.Random) -> set[str]:
    """The batch file; returns the ids of the good items."""
    lines, good = [], []
    for i in range(n):
        roll = rng.random()
        if roll < 0.12:
            lines.append(bad_line(rng.choice(BAD_LINES), i, rng, good))
            continue
        record = {"id": f"item-{i:03d}", "text": " ".join(rng.choices(WORDS, k=4)) + ".",
                  "seed": i, "prompt_audio": "good.wav"}
        if roll < 0.2:
            record["prompt_audio"] = rng.choice(BAD_AUDIO)
        else:
            good.append(record["id"])
        lines.append(json.dumps(record).encode())
    (root / "batch.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return set(good)


class Soak:
    """Runs the batch command under faults and keeps the counts."""

    def __init__(self, root: Path, args, rng: random.Random, good: int):
        self.root, self.args, self.rng, self.good = root, args, rng, good
        self.task_dir = root / "out" / TASK
        self.command = [str(ENTRY_POINT), "synth", "--model", "tiny", "--task", TASK,
                        "--input", "batch.jsonl", "--max-new-groups", str(args.max_new_groups),
                        "--output-dir", "out", "--json"]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "NO_COLOR": "1"}
        self.counts = {"runs": 0, "faults": {f: 0 for f in (*FAULTS, "concurrent")},
                       "temp_files_left_by_kills": 0, "wavs_after_each_run": []}

    def wavs(self) -> int:
        if not self.task_dir.is_dir():
            return 0
        return sum(1 for p in self.task_dir.iterdir() if p.suffix == ".wav")

    def temps(self) -> int:
        return len(list(self.root.rglob(".mimo-tmp-*")))

    def start(self) -> subprocess.Popen:
        self.counts["runs"] += 1
        return subprocess.Popen(self.command, cwd=self.root, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL)

    def wait_for_progress(self, proc, more: int, timeout: float = 120) -> None:
        target, deadline = self.wavs() + more, time.monotonic() + timeout
        while proc.poll() is None and self.wavs() < target and time.monotonic() < deadline:
            time.sleep(0.01)

    def faulted_run(self, fault: str) -> None:
        proc = self.start()
        if fault == "kill9-early":
            time.sleep(self.rng.uniform(0.2, 3.0))  # often while loading
        else:  # after a few more items, while some are left to do
            left = self.good - self.wavs()
            self.wait_for_progress(proc, self.rng.randint(1, max(1, min(25, left // 2))))
        sig = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}.get(fault, signal.SIGKILL)
        if proc.poll() is None:
            proc.send_signal(sig)
            self.counts["faults"][fault] += 1
        _, err = proc.communicate(timeout=300)
        if sig != signal.SIGKILL and proc.returncode not in (130, 0, 8):
            raise RuntimeError(f"{fault}: exit {proc.returncode}: {err.decode()[-400:]}")
        if sig == signal.SIGKILL:
            self.counts["temp_files_left_by_kills"] += self.temps()
        self.counts["wavs_after_each_run"].append(self.wavs())

    def concurrent_run(self) -> None:
        """A second run while the first holds the directory: refused with exit 5."""
        first = self.start()
        lock = self.task_dir / ".mimo-tts.lock"
        self.wait_for_progress(first, 1)
        second = subprocess.run(self.command, cwd=self.root, env=self.env, capture_output=True,
                                stdin=subprocess.DEVNULL, timeout=300)
        self.counts["runs"] += 1
        if first.poll() is None and lock.is_file():
            if second.returncode != 5 or b"another mimo-tts run" not in second.stderr:
                raise RuntimeError(f"second run not refused: exit {second.returncode}")
            self.counts["faults"]["concurrent"] += 1
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=300)
        self.counts["temp_files_left_by_kills"] += self.temps()
        self.counts["wavs_after_each_run"].append(self.wavs())

    def final_run(self) -> list[dict]:
        proc = subprocess.run(self.command, cwd=self.root, env=self.env, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=1800)
        self.counts["runs"] += 1
        self.counts["final_exit_code"] = proc.returncode
        self.counts["wavs_after_each_run"].append(self.wavs())
        return [json.loads(x) for x in proc.stdout.decode().splitlines()]


def check(root: Path, good: set[str], final: list[dict]) -> tuple[dict, list[str]]:
    """Every good item: one valid wav + one ok line (key = sidecar key); bad: error line only."""
    task_dir = root / "out" / TASK
    problems: list[str] = []
    raw = (task_dir / "results.jsonl").read_text(encoding="utf-8").splitlines()
    lines = [json.loads(x) for x in raw]
    ids = [r["id"] for r in lines]
    if len(ids) != len(set(ids)):
        problems.append("manifest has more than one line for an id")
    by_id = {r["id"]: r for r in lines}
    wavs = {p.stem for p in task_dir.glob("*.wav")}
    for item_id in sorted(good):
        problems += _check_good(task_dir, item_id, by_id.get(item_id))
    bad = set(by_id) - good
    problems += [f"{i}: bad item has status {by_id[i]['status']}" for i in sorted(bad)
                 if by_id[i]["status"] != "error" or by_id[i]["exit_code"] != 9]
    if wavs != good:
        problems.append(f"wav files differ from the good items: extra {sorted(wavs - good)[:5]},"
                        f" missing {sorted(good - wavs)[:5]}")
    temps = list(root.rglob(".mimo-tmp-*"))
    if temps:
        problems.append(f"temp files remain: {[p.name for p in temps][:5]}")
    statuses = [r["status"] for r in final]
    counts = {"good_items": len(good), "bad_items": len(bad), "wavs": len(wavs),
              "manifest_lines": len(lines), "temp_files_at_end": len(temps),
              "final_run": {s: statuses.count(s) for s in ("ok", "skipped", "error")}}
    return counts, problems


def _check_good(task_dir: Path, item_id: str, line: dict | None) -> list[str]:
    if line is None or line["status"] != "ok":
        return [f"{item_id}: manifest line {line and line['status']}"]
    wav = task_dir / f"{item_id}.wav"
    try:
        info = sf.info(str(wav))
        audio, _ = sf.read(str(wav), dtype="float32")
        sidecar = json.loads((task_dir / f"{item_id}.json").read_text(encoding="utf-8"))
    except (OSError, RuntimeError, ValueError) as exc:
        return [f"{item_id}: unreadable output: {exc}"]
    ok = (info.samplerate == 24000 and info.channels == 1 and info.subtype == "PCM_16"
          and info.frames > 0 and info.frames % 960 == 0 and np.isfinite(audio).all()
          and float(np.abs(audio).max()) > 1e-4)
    problems = [] if ok else [f"{item_id}: invalid wav {info}"]
    if sidecar.get("result", {}).get("key") != line["key"]:
        problems.append(f"{item_id}: sidecar key differs from the manifest line")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--faults", type=int, default=6, help="faulted runs before the last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-groups", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="mimo-tts-soak-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        write_voices(root)
        good = write_batch(root, args.items, rng)
        soak = Soak(root, args, rng, len(good))
        for n in range(args.faults):
            soak.concurrent_run() if n == 1 else soak.faulted_run(rng.choice(FAULTS))
        final = soak.final_run()
        counts, problems = check(root, good, final)
        report = {"items": args.items, **counts, **soak.counts,
                  "seconds": round(time.perf_counter() - start, 1),
                  "ok": not problems and soak.counts.get("final_exit_code") in (0, 8),
                  "problems": problems[:20]}
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
