"""Hash what a user hears from a fixed set of tiny-preset runs on every face, as JSON on stdout.

Run it before and after a change that must not change behaviour, and compare the two reports
(`--compare BEFORE.json`): every case must hash the same. The cases:

- `synth`: the four tasks; `--batch-size 1`, `3` and `4` over three items with their own seeds;
  `--stream` in both stream modes (the file, and the raw PCM on stdout); `decode` of saved codes;
- the library: `synthesize`, `synthesize_batch` at `batch_size=1` and `3`, `stream` (the chunks
  joined);
- `serve`: a wav response and a streamed pcm response; `wyoming`: one `synthesize`;
- `book`: a three-chapter Markdown book (each chapter file and `book.m4b` when PyAV is there);
- Ray (`--ray-python`, a venv with the ray extra): `scripts/ray_synth.py` over the items.

Audio is hashed as bytes (files, response bodies, PCM) or, for the library, as the float32
samples. `--python` picks the interpreter (default: this one); the package it imports is the one
that interpreter finds, so set PYTHONPATH to hash another checkout:

    python scripts/check_identity.py > before.json
    ... change the code ...
    python scripts/check_identity.py --compare before.json
    PYTHONPATH=../old python scripts/check_identity.py --cases library,book   # a subset
"""

from __future__ import annotations

import argparse
import asyncio
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
BASE = ["--model", "tiny", "--lm-device", "cpu", "--tokenizer-device", "cpu", "--seed", "5",
        "-q"]
BOOK = """# A Small Book

## The First Chapter

It begins here. A second sentence ends the first paragraph.

The chapter's last paragraph is short.

## The Second Chapter

Another chapter, another voice line.

## The Third Chapter

The end comes quickly. Goodbye.
"""
LIBRARY = r"""
import hashlib, json, sys
import numpy as np
import mimo_tts

texts = json.loads(sys.argv[1])
tts = mimo_tts.load("tiny", lm_device="cpu", tokenizer_device="cpu")
h = lambda samples: hashlib.sha256(np.ascontiguousarray(samples, np.float32).tobytes()).hexdigest()
out = {"synthesize": h(tts.synthesize(texts[0], seed=7).samples)}
for size in (1, 3):
    made = tts.synthesize_batch(texts, batch_size=size, seed=7)
    out[f"synthesize_batch_{size}"] = [h(a.samples) for a in made]
out["stream"] = h(np.concatenate([c.samples for c in tts.stream(texts[0], seed=7)]))
print(json.dumps(out))
"""
CASES = ("synth", "library", "server", "wyoming", "book", "ray")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cli(python: str, *args: str, cwd: Path, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run([python, "-c", ENTRY, *args], cwd=cwd, capture_output=True,
                          env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace')[-2000:]}")
    return done


def files(folder: Path, pattern: str = "*.wav") -> dict[str, str]:
    return {str(p.relative_to(folder)): sha(p.read_bytes())
            for p in sorted(folder.rglob(pattern))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synth_cases(python: str, root: Path) -> dict:
    out: dict[str, object] = {}
    cli(python, "synth", *BASE, "--text", TEXTS[0], "--output-dir", str(root / "plain"),
        "--save-codes", cwd=root)
    out["tts_sft"] = files(root / "plain")
    prompt = next((root / "plain").rglob("*.wav"))
    cli(python, "synth", *BASE, "--task", "tts_sft_with_instruct", "--instruct",
        "calm, low voice", "--text", TEXTS[1], "--output-dir", str(root / "instruct"), cwd=root)
    out["tts_sft_with_instruct"] = files(root / "instruct")
    cli(python, "synth", *BASE, "--task", "tts_sft_with_audio", "--prompt-audio", str(prompt),
        "--text", TEXTS[2], "--output-dir", str(root / "audio"), cwd=root)
    out["tts_sft_with_audio"] = files(root / "audio")
    cli(python, "synth", *BASE, "--task", "tts_sft_with_natural_instruction", "--text",
        "Say it softly: " + TEXTS[1], "--output-dir", str(root / "natural"), cwd=root)
    out["tts_sft_with_natural_instruction"] = files(root / "natural")
    for size in (1, 3, 4):
        cli(python, "synth", *BASE, "--input", str(root / "items.jsonl"), "--batch-size",
            str(size), "--output-dir", str(root / f"batch{size}"), cwd=root)
        out[f"batch_size_{size}"] = files(root / f"batch{size}")
    for mode in ("incremental", "official"):
        cli(python, "synth", *BASE, "--stream", "--stream-mode", mode, "--text", TEXTS[0],
            "--output-dir", str(root / f"stream-{mode}"), cwd=root)
        out[f"stream_{mode}"] = files(root / f"stream-{mode}")
        raw = cli(python, "synth", *BASE, "--stream", "--stream-mode", mode, "--raw",
                  "--text", TEXTS[0], "--output-dir", str(root / f"raw-{mode}"), cwd=root)
        out[f"stream_{mode}_raw"] = sha(raw.stdout)
    codes = next((root / "plain").rglob("*.codes.safetensors"))
    sidecar = next((root / "plain").rglob("*.json"))
    tokenizer = json.loads(sidecar.read_text())["tokenizer"]["path"]
    cli(python, "decode", str(codes), "--tokenizer", tokenizer, "--tokenizer-device", "cpu",
        "-o", str(root / "decoded.wav"), cwd=root)
    out["decode"] = sha((root / "decoded.wav").read_bytes())
    return out


def library_cases(python: str, root: Path) -> dict:
    done = subprocess.run([python, "-c", LIBRARY, json.dumps(TEXTS)], cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"library calls exited {done.returncode}: {done.stderr[-2000:]}")
    return {f"library_{k}": v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


class Server:
    """A `serve` or `wyoming` process on a free port, stopped on exit."""

    def __init__(self, python: str, command: str, root: Path):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [python, "-c", ENTRY, command, "--model", "tiny", "--port", str(self.port),
             "--lm-device", "cpu", "--tokenizer-device", "cpu"], cwd=root,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)

    def wait(self, ready) -> None:
        for _ in range(1500):
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited {self.proc.returncode}: "
                                 f"{self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                ready()
                return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("server did not start")


def server_cases(python: str, root: Path) -> dict:
    out = {}
    with Server(python, "serve", root) as server:
        url = f"http://127.0.0.1:{server.port}"
        server.wait(lambda: urllib.request.urlopen(url + "/health", timeout=1))
        for fmt in ("wav", "pcm"):
            body = json.dumps({"model": "tiny", "input": TEXTS[0], "voice": "default",
                               "response_format": fmt, "seed": 3}).encode()
            request = urllib.request.Request(url + "/v1/audio/speech", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                out[f"server_{fmt}"] = sha(response.read())
    return out


def wyoming_cases(python: str, root: Path) -> dict:
    from wyoming.audio import AudioChunk
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    async def speak(port: int) -> bytes:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text=TEXTS[0]).event())
            pcm = b""
            while True:
                event = await asyncio.wait_for(client.read_event(), 600)
                if event is None or event.type in ("audio-stop", "error"):
                    if event is None or event.type == "error":
                        raise SystemExit(f"wyoming: {event}")
                    return pcm
                if AudioChunk.is_type(event.type):
                    pcm += AudioChunk.from_event(event).audio

    with Server(python, "wyoming", root) as server:
        server.wait(lambda: socket.create_connection(("127.0.0.1", server.port), 1).close())
        return {"wyoming": sha(asyncio.run(speak(server.port)))}


def book_cases(python: str, root: Path) -> dict:
    book = root / "small-book.md"
    book.write_text(BOOK)
    # Since issue 32 a book without a voice is read in its first piece's voice; a checkout
    # that has the choice reads it the old way (a voice per piece), so books stay comparable
    # with a recording from before. The book-voice path has its own tests.
    helped = cli(python, "book", "--help", cwd=root).stdout.decode(errors="replace")
    old_way = ["--voice-per-piece"] if "--voice-per-piece" in helped else []
    cli(python, "book", str(book), "--output-dir", str(root / "book"), *BASE, *old_way,
        cwd=root)
    out = {"book_chapters": files(root / "book" / "chapters")}
    if (root / "book" / "book.m4b").exists():
        out["book_m4b"] = sha((root / "book" / "book.m4b").read_bytes())
    return out


def ray_cases(python: str, root: Path, script: Path) -> dict:
    done = subprocess.run([python, str(script), str(root / "items.jsonl"), "--output-dir",
                           str(root / "ray"), "--model", "tiny", "--lm-device", "cpu",
                           "--tokenizer-device", "cpu", "--seed", "5"], cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ray_synth exited {done.returncode}: {done.stderr[-2000:]}")
    return {"ray": files(root / "ray")}


def report(python: str, cases: list[str], ray_python: str | None, ray_script: Path) -> dict:
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="mimo-identity-") as tmp:
        root = Path(tmp)
        lines = root / "items.jsonl"  # own seeds: the tiny preset's audio follows the seed
        lines.write_text("".join(json.dumps({"text": t, "seed": 11 + n}) + "\n"
                                 for n, t in enumerate(TEXTS)))
        runs = {"synth": synth_cases, "library": library_cases, "server": server_cases,
                "wyoming": wyoming_cases, "book": book_cases}
        for name in cases:
            if name == "ray":
                if ray_python:
                    out.update(ray_cases(ray_python, root, ray_script))
                continue
            out.update(runs[name](python, root))
    return out


def _hashes(entry) -> list | None:
    """A case's audio hashes, whatever the files are named (names may change, bytes may not)."""
    if isinstance(entry, dict):
        return sorted(entry.values())
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--ray-python", help="an interpreter with the ray extra (case ray)")
    parser.add_argument("--ray-script", type=Path, default=Path(__file__).with_name(
        "ray_synth.py"), help="the checkout's scripts/ray_synth.py (default: beside this one)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"a subset of {','.join(CASES)}")
    parser.add_argument("--compare", metavar="BEFORE.json")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s): {', '.join(unknown)}")
    now = report(args.python, cases, args.ray_python, args.ray_script)
    print(json.dumps(now, indent=1, sort_keys=True))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        keys = set(now) | (set(before) if set(cases) >= set(CASES) - {"ray"} else set())
        differ = sorted(k for k in keys if _hashes(before.get(k)) != _hashes(now.get(k)))
        renamed = sorted(k for k in set(before) & set(now) if k not in differ
                         and before[k] != now[k])  # same bytes under other file names
        print(json.dumps({"identical": not differ, "cases": len(keys), "differ": differ,
                          "renamed": renamed}), file=sys.stderr)
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MIMO_TTS_CPU_KERNEL", "auto")
    sys.exit(main())
