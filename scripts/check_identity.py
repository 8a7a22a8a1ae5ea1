"""Hash the audio bytes of a fixed set of tiny-preset commands, as JSON on stdout.

Run it before and after a change that must not change behaviour, and compare the two reports
(`--compare BEFORE.json`): every command's wav must hash the same. The cases cover the four
tasks, `--batch-size 1` and `3`, `--stream`, `decode` and the server's wav.

    python scripts/check_identity.py > before.json
    ... change the code ...
    python scripts/check_identity.py --compare before.json

`--python` picks the interpreter (default: this one); the package it imports is the one that
interpreter finds, so set PYTHONPATH to hash another checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ENTRY = "from mimo_tts.cli import main; main()"  # the console script's target
TEXTS = ["Hello from MiMo. A second sentence follows it.", "Short one.",
         "The third item has a few more words in it."]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cli(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([python, "-c", ENTRY, *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done


def wavs(folder: Path) -> dict[str, str]:
    return {p.name: sha(p) for p in sorted(folder.rglob("*.wav"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_wav(python: str, cwd: Path) -> str:
    port = free_port()
    proc = subprocess.Popen([python, "-c", ENTRY, "serve", "--model", "tiny", "--port", str(port),
                             "--lm-device", "cpu", "--tokenizer-device", "cpu"], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"model": "tiny", "input": TEXTS[0], "voice": "default",
                           "response_format": "wav", "seed": 3}).encode()
        request = urllib.request.Request(url + "/v1/audio/speech", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return hashlib.sha256(response.read()).hexdigest()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def report(python: str) -> dict:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="mimo-identity-") as tmp:
        root = Path(tmp)
        base = ["synth", "--model", "tiny", "--lm-device", "cpu", "--tokenizer-device", "cpu",
                "--seed", "5", "-q"]
        cli(python, *base, "--text", TEXTS[0], "--output-dir", str(root / "plain"),
            "--save-codes", cwd=root)
        out["tts_sft"] = wavs(root / "plain")
        prompt = next((root / "plain").rglob("*.wav"))
        cli(python, *base, "--task", "tts_sft_with_instruct", "--instruct", "calm, low voice",
            "--text", TEXTS[1], "--output-dir", str(root / "instruct"), cwd=root)
        out["tts_sft_with_instruct"] = wavs(root / "instruct")
        cli(python, *base, "--task", "tts_sft_with_audio", "--prompt-audio", str(prompt),
            "--text", TEXTS[2], "--output-dir", str(root / "audio"), cwd=root)
        out["tts_sft_with_audio"] = wavs(root / "audio")
        cli(python, *base, "--task", "tts_sft_with_natural_instruction", "--text",
            "Say it softly: " + TEXTS[1], "--output-dir", str(root / "natural"), cwd=root)
        out["tts_sft_with_natural_instruction"] = wavs(root / "natural")
        lines = root / "items.jsonl"  # own seeds: the tiny preset's audio follows the seed
        lines.write_text("".join(json.dumps({"text": t, "seed": 11 + n}) + "\n"
                                 for n, t in enumerate(TEXTS)))
        for size in (1, 3):
            cli(python, *base, "--input", str(lines), "--batch-size", str(size),
                "--output-dir", str(root / f"batch{size}"), cwd=root)
            out[f"batch_size_{size}"] = wavs(root / f"batch{size}")
        cli(python, *base, "--stream", "--text", TEXTS[0], "--output-dir", str(root / "stream"),
            cwd=root)
        out["stream"] = wavs(root / "stream")
        codes = next((root / "plain").rglob("*.codes.safetensors"))
        cli(python, "decode", str(codes), "--tokenizer", str(_tiny_tokenizer(python, root)),
            "--tokenizer-device", "cpu", "-o", str(root / "decoded.wav"), cwd=root)
        out["decode"] = sha(root / "decoded.wav")
        out["server_wav"] = server_wav(python, root)
    return out


def _tiny_tokenizer(python: str, cwd: Path) -> Path:
    """The tiny preset's audio tokenizer directory, as the sidecar of the plain run names it."""
    sidecar = next((cwd / "plain").rglob("*.json"))
    return Path(json.loads(sidecar.read_text())["tokenizer"]["path"])


def _hashes(entry) -> list | None:
    """A case's audio hashes, whatever the files are named (names may change, bytes may not)."""
    if isinstance(entry, dict):
        return sorted(entry.values())
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--compare", metavar="BEFORE.json")
    args = parser.parse_args()
    now = report(args.python)
    print(json.dumps(now, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = sorted(k for k in set(before) | set(now)
                        if _hashes(before.get(k)) != _hashes(now.get(k)))
        renamed = sorted(k for k in set(before) & set(now) if k not in differ
                         and before[k] != now[k])  # same bytes under other file names
        print(json.dumps({"identical": not differ, "differ": differ, "renamed": renamed}),
              file=sys.stderr)
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MIMO_TTS_CPU_KERNEL", "auto")
    sys.exit(main())
