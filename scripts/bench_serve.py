"""Load-test `mimo-tts serve`: N concurrent clients, M requests each; latency and first byte, JSON.

For each model (`tiny`: the built-in preset; `full4`: the published LM width, hidden 4096 with
4 backbone layers and the full patch encoder/decoder, bfloat16, written once to a temp dir with
`presets.write.write_random_checkpoint`, beside `bench_overlap.py`'s mid-size audio tokenizer, and
deleted at the end) the script starts one real server subprocess on 127.0.0.1 and, for each
client count in turn, runs that many threads, each sending `--requests` streamed `pcm` requests one
after another over httpx. Per run: p50/p95 of the request latency and of the time to the first
audio byte, requests and audio seconds per second, status counts and the server's batch stats
(/health). Every client gets a distinct text; seeds are the server's default. The native engine
runs the speech worker's continuous batch (`synthesis/worker.py`), recorded per run.

Each model is served in two variants at once (`--variants`), whose runs alternate round by
round (`--rounds`, paired ratios, median over the rounds). A variant `NAME=DIR` is the defaults
served from the checkout at DIR (its package first on the server's PYTHONPATH): `--variants
before=../old,after` compares a change with the code before it, back to back. The named
variants: `before`, the Stage-1 of
issue 24's start (one push decoded at a time, `--stage1-batch 1`, and a first push 5 groups past
the decoder's look-ahead, the first audio after 15 groups as with the old 5-then-10 pushes), and
`after` (the defaults: streamed requests' pushes decoded together, the first push one group past
the look-ahead); `together` (old pushes, decoded together) and `growing` (new pushes, one at a
time) part the two changes. `vs_before` gives, per variant and client count, variant / before
for audio seconds per second and before / variant for the time to first audio (p50, p95): above
1 is better.

    .venv/bin/python scripts/bench_serve.py [--models tiny,full4] [--clients 1,4,16]
        [--requests 3] [--batch-size 8] [--variants before,after] [--rounds 3]
        [--out docs/bench-serve.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from _common import checkout_env
from bench import machine
from bench_overlap import CODEC_DIMS

START_TIMEOUT_S = 600
SAMPLE_BYTES = 2  # pcm: 16-bit mono at 24 kHz
SAMPLE_RATE = 24000


def full4_checkpoint(root: Path) -> tuple[Path, Path]:
    """The full-width LM with 4 backbone layers (bfloat16) and the mid-size tokenizer."""
    import torch

    from mimo_tts.presets.lm import FULL_LM
    from mimo_tts.presets.write import write_random_checkpoint

    return write_random_checkpoint(root, {**FULL_LM, "num_hidden_layers": 4}, CODEC_DIMS,
                                   lm_dtype=torch.bfloat16)


def variant_args(name: str, work: Path) -> list[str]:
    """The serve flags of a variant: `after` is the defaults; `before` the old pushes decoded
    one at a time; `together` the old pushes decoded together; `growing` the new pushes
    decoded one at a time; `NAME=DIR` the defaults (from another checkout)."""
    if "=" in name:
        return []
    profile = work / "before.toml"
    profile.write_text("stream_chunk_groups = 5\n", encoding="utf-8")
    return {"after": [], "before": ["--stage1-batch", "1", "--config", str(profile)],
            "together": ["--config", str(profile)], "growing": ["--stage1-batch", "1"]}[name]


def variant_env(variant: str) -> dict | None:
    """The server's environment for a variant `NAME=DIR`: DIR's package first (else None)."""
    return checkout_env(variant.split("=", 1)[1]) if "=" in variant else None


def start_server(model_args: list[str], batch_size: int, clients: int, log: Path,
                 env: dict | None = None):
    """A `mimo-tts serve` child on a free port; (process, base url) once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "mimo_tts.cli", "serve", *model_args, "--port", str(port),
            "--batch-size", str(batch_size), "--max-concurrent", str(clients),
            "--max-queue", str(clients), "--timeout", "3600"]
    with open(log, "wb") as handle:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=handle, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server did not start in {START_TIMEOUT_S} s")


def one_request(client: httpx.Client, text: str) -> dict:
    """One streamed pcm request: status, seconds to the first byte and to the end, audio s."""
    start = time.perf_counter()
    first, size = None, 0
    with client.stream("POST", "/v1/audio/speech", json={
            "model": "mimo-tts", "input": text, "response_format": "pcm"}) as response:
        for chunk in response.iter_raw():
            first = first or time.perf_counter()
            size += len(chunk)
        status = response.status_code
    end = time.perf_counter()
    return {"status": status, "ttfb_s": (first or end) - start, "latency_s": end - start,
            "audio_s": size / SAMPLE_BYTES / SAMPLE_RATE if status == 200 else 0.0}


def load_run(url: str, clients: int, requests: int) -> dict:
    """`clients` threads, each sending `requests` requests back to back."""
    results: list[dict] = []
    lock = threading.Lock()

    def client_loop(n: int) -> None:
        with httpx.Client(base_url=url, timeout=3600) as client:
            for i in range(requests):
                found = one_request(client, f"Client {n} asks for sentence number {i}.")
                with lock:
                    results.append(found)

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(clients)]
    before = httpx.get(url + "/health", timeout=30).json()
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200]
    health = httpx.get(url + "/health", timeout=30).json()
    return {"clients": clients, "requests": len(results), "wall_s": round(wall, 3),
            "status": {str(s): sum(r["status"] == s for r in results)
                       for s in sorted({r["status"] for r in results})},
            "latency_s": _percentiles([r["latency_s"] for r in ok]),
            "ttfb_s": _percentiles([r["ttfb_s"] for r in ok]),
            "requests_per_s": round(len(ok) / wall, 3),
            "audio_s_per_s": round(sum(r["audio_s"] for r in ok) / wall, 3),
            "server": {"rows": health["rows"] - before["rows"],  # Stage-0 rows of this run
                       "max_batch_rows_since_start": health["max_batch_rows"],
                       "stage1_rounds": health.get("stage1_rounds", 0)
                       - before.get("stage1_rounds", 0),
                       "max_stage1_jobs_since_start": health.get("max_stage1_jobs"),
                       "rejected": health["requests"]["rejected"]
                       - before["requests"]["rejected"]}}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 3), "p95": round(p95, 3),
            "max": round(ordered[-1], 3)}


def bench_model(name: str, model_args: list[str], args, work: Path) -> dict:
    """One server per variant, all up at once (limits sized to the largest client count, so
    nothing is refused), each warmed up by one request. Then, per client count, `--rounds`
    rounds in which every variant runs once, in an order that alternates between rounds, so
    that each comparison pairs runs taken back to back under the same load."""
    servers = {}
    try:
        for variant in args.variants:
            served = model_args + variant_args(variant, work)
            proc, url = start_server(served, args.batch_size, max(args.clients),
                                     work / f"serve-{variant.split('=')[0]}.log",
                                     variant_env(variant))
            servers[variant] = (proc, url, served)
            with httpx.Client(base_url=url, timeout=3600) as client:
                one_request(client, "Warm up.")  # first-call costs (kernel build, allocations)
        runs: dict[str, list] = {v: [] for v in args.variants}
        for clients in args.clients:
            for round_ in range(args.rounds):
                order = args.variants if round_ % 2 == 0 else args.variants[::-1]
                for variant in order:
                    run = load_run(servers[variant][1], clients, args.requests)
                    runs[variant].append(run | {"round": round_})
                    print(json.dumps({"model": name, "variant": variant, **run}),
                          file=sys.stderr)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    variants = {v.split("=")[0]: {"args": servers[v][2], "runs": runs[v],
                                  **({"checkout": v.split("=", 1)[1]} if "=" in v else {})}
                for v in args.variants}
    return {"model": name, "strategy": "continuous", "variants": variants,
            "vs_before": compare(variants)}


def compare(variants: dict) -> dict | None:
    """Per other variant and client count, medians over the rounds of the paired ratios:
    audio s/s variant / before, first audio before / variant (> 1: better than before)."""
    if "before" not in variants:
        return None
    out = {}
    for name, variant in variants.items():
        if name == "before":
            continue
        pairs: dict[int, list] = {}
        for old, new in zip(variants["before"]["runs"], variant["runs"], strict=True):
            row = {}
            if old["audio_s_per_s"]:
                row["audio_s_per_s"] = new["audio_s_per_s"] / old["audio_s_per_s"]
            for key in ("p50", "p95"):
                if new["ttfb_s"].get(key) and old["ttfb_s"].get(key):
                    row[f"ttfa_{key}"] = old["ttfb_s"][key] / new["ttfb_s"][key]
            pairs.setdefault(old["clients"], []).append(row)
        out[name] = [{"clients": clients, "rounds": len(rows),
                      **{key: round(statistics.median(r[key] for r in rows if key in r), 3)
                         for key in ("audio_s_per_s", "ttfa_p50", "ttfa_p95")
                         if any(key in r for r in rows)}}
                     for clients, rows in pairs.items()]
    return out or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,full4")
    parser.add_argument("--clients", default="1,4,16",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per client count")
    parser.add_argument("--variants", default="before,after", type=lambda s: s.split(","),
                        help="comma-separated: before, after, together, growing, or "
                             "NAME=DIR (the defaults from the checkout at DIR)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
              "batch_size": args.batch_size, "requests_per_client": args.requests,
              "rounds": args.rounds,
              "format": "pcm (streamed)", "models": []}
    work = Path(tempfile.mkdtemp(prefix="mimo-bench-serve-"))
    try:
        for name in args.models.split(","):
            if name == "tiny":
                model_args = ["--model", "tiny"]
            else:
                lm, tok = full4_checkpoint(work / "full4")
                model_args = ["--model", str(lm), "--tokenizer", str(tok)]
            report["models"].append(bench_model(name, model_args, args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
