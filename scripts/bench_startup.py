"""Start-up benchmark: CLI latency without torch, and peak RSS while loading the full tokenizer.

1. `mimo-tts --help` and `mimo-tts devices`: best wall time of N fresh processes (target
   < 0.5 s), plus one instrumented run that reports which heavy modules got imported (target:
   no torch on either path).
2. Loading the full-size audio tokenizer (random weights in the official layout, written once
   and reused) in a fresh process, then reading every weight once (as the first decode does,
   so memory-mapped pages count): peak resident memory (ru_maxrss, baseline of interpreter +
   torch included) over the weights' size (target <= 1.2x). A loader that copies the tensors
   shows ~2x; one that maps them shows ~1x plus the baseline.

    .venv/bin/python scripts/bench_startup.py [--quick] [--runs 5] [--weights-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import FULL_SIZE

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_CONFIG = FULL_SIZE / "tokenizer-config.json"
DEFAULT_WEIGHTS = Path(tempfile.gettempdir()) / "mimo-tts-bench" / "tokenizer-full-f32"
CLI_TARGET_S, RSS_TARGET = 0.5, 1.2
HEAVY_MODULES = ("torch", "torchaudio", "numpy", "safetensors", "tokenizers", "soundfile")
COMMANDS = {"help": ["--help"], "devices": ["devices"]}

# Runs the real CLI entry point, then (at exit, after typer's SystemExit) reports what it imported.
TRACE = """
import atexit, json, sys
heavy = {heavy!r}
atexit.register(lambda: sys.stderr.write(
    "\\nMODULES " + json.dumps([m for m in heavy if m in sys.modules]) + "\\n"))
sys.argv = ["mimo-tts", *{args!r}]
from mimo_tts.cli import main
main()
"""

# Loads the tokenizer in a fresh process: peak RSS before (baseline) and after loading.
LOAD = """
import json, resource, sys, time
import torch
from mimo_tts.codec import load_audio_tokenizer
from mimo_tts.codec.layers import weight_tensors
torch.set_num_threads(1)
kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
base = kib()
start = time.perf_counter()
tok = load_audio_tokenizer(sys.argv[1], "cpu", sys.argv[2])
seconds = time.perf_counter() - start
loaded = kib()
with torch.no_grad():  # read every weight once, as the first decode would (maps fault in)
    for tensor in weight_tensors(tok.model):
        if not tensor.is_mkldnn:  # oneDNN's reordered weights: opaque, written at load
            tensor.sum()
print(json.dumps({{"baseline_kib": base, "loaded_kib": loaded, "peak_kib": kib(),
                  "load_s": seconds}}))
"""


def cli_command() -> list[str]:
    """The installed `mimo-tts` next to this interpreter, else `python -m mimo_tts.cli`."""
    exe = Path(sys.executable).parent / "mimo-tts"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "mimo_tts.cli"]


def time_command(args: list[str], runs: int) -> dict:
    """Best and median wall seconds of `runs` fresh processes, exit code, imported modules."""
    times, rc = [], None
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(cli_command() + args, capture_output=True, timeout=300)
        times.append(time.perf_counter() - start)
        rc = done.returncode
    traced = subprocess.run([sys.executable, "-c", TRACE.format(heavy=HEAVY_MODULES, args=args)],
                            capture_output=True, text=True, timeout=300)
    line = [ln for ln in traced.stderr.splitlines() if ln.startswith("MODULES ")]
    imported = json.loads(line[-1].removeprefix("MODULES ")) if line else None
    times.sort()
    return {"args": args, "best_s": round(times[0], 3),
            "median_s": round(times[len(times) // 2], 3), "runs": runs, "exit_code": rc,
            "target_s": CLI_TARGET_S,
            "meets_target": times[0] < CLI_TARGET_S, "heavy_imports": imported,
            "torch_imported": None if imported is None else "torch" in imported}


# --- random full-size weights, written tensor by tensor (never all in memory) -------------------


def _tensor_specs(config: dict) -> list[tuple[str, list[int]]]:
    """Every checkpoint tensor (the model's state dict plus the RVQ EMA buffers), sorted."""
    from mimo_tts.codec.config import CodecConfig
    from mimo_tts.codec.load import build_model

    model = build_model(CodecConfig.from_json(config))
    specs = {name: list(t.shape) for name, t in model.state_dict().items()}
    for name, shape in list(specs.items()):
        if name.endswith("._codebook.embed"):  # training-only EMA state ships in the checkpoint
            base = name.removesuffix("embed")
            specs |= {base + "embed_avg": shape, base + "cluster_size": shape[:1],
                      base + "inited": [1]}
    return sorted(specs.items())


def _fill(name: str, shape: list[int], generator):
    """Plausible random values: unit norm weights, a Hann window, small Gaussians elsewhere."""
    import torch

    if name.endswith("istft.window"):
        return torch.hann_window(shape[0], periodic=True)
    if "norm" in name or name.endswith(("cluster_size", "inited")):
        value = 1.0 if name.endswith(("weight", "cluster_size", "inited")) else 0.0
        return torch.full(shape, value)
    return torch.randn(shape, generator=generator) * 0.02


def write_random_tokenizer(directory: Path, config_path: Path = TOKENIZER_CONFIG) -> int:
    """config.json + model.safetensors (float32) in `directory`; returns the weights' bytes.

    Reused when already complete (a marker file records the byte count).
    """
    marker = directory / ".complete"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if marker.is_file() and json.loads(marker.read_text())["config"] == config:
        return json.loads(marker.read_text())["bytes"]
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    specs = _tensor_specs(config)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        size = 4 * _numel(shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    generator = torch.Generator().manual_seed(0)
    tmp = directory / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in specs:
            f.write(_fill(name, shape, generator).contiguous().numpy().tobytes())
    os.replace(tmp, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    marker.write_text(json.dumps({"config": config, "bytes": offset}))
    return offset


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def measure_load(directory: Path, weight_bytes: int, dtype: str) -> dict:
    """Peak RSS of a fresh process loading the tokenizer, against the weights' size."""
    done = subprocess.run([sys.executable, "-c", LOAD.format(), str(directory), dtype],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"loading failed: {done.stderr.strip()[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    peak, base = found["peak_kib"] * 1024, found["baseline_kib"] * 1024
    ratio = peak / weight_bytes
    return {"weights_gb": round(weight_bytes / 1e9, 3), "weights_dtype": "float32",
            "load_dtype": dtype, "load_s": round(found["load_s"], 2),
            "baseline_rss_gb": round(base / 1e9, 3),
            "rss_after_load_gb": round(found["loaded_kib"] * 1024 / 1e9, 3),
            "peak_rss_gb": round(peak / 1e9, 3),
            "peak_rss_over_weights": round(ratio, 3),
            "added_rss_over_weights": round((peak - base) / weight_bytes, 3),
            "target": RSS_TARGET, "meets_target": ratio <= RSS_TARGET}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 runs per command")
    parser.add_argument("--runs", type=int, default=5, help="processes per CLI command")
    parser.add_argument("--weights-dir", type=Path, default=DEFAULT_WEIGHTS,
                        help=f"the random full-size tokenizer (default {DEFAULT_WEIGHTS})")
    parser.add_argument("--load-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--no-load", action="store_true", help="skip the loading measurement")
    parser.add_argument("--no-cli", action="store_true", help="skip the CLI timings")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    report: dict = {"benchmark": "startup", "python": sys.version.split()[0],
                    "load_average": os.getloadavg()}
    if not args.no_cli:
        report["cli"] = {name: time_command(argv, runs) for name, argv in COMMANDS.items()}
        print(json.dumps(report["cli"]), file=sys.stderr)
    if not args.no_load:
        start = time.perf_counter()
        weight_bytes = write_random_tokenizer(args.weights_dir)
        report["weights_dir"] = str(args.weights_dir)
        report["write_s"] = round(time.perf_counter() - start, 1)
        report["load"] = measure_load(args.weights_dir, weight_bytes, args.load_dtype)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
