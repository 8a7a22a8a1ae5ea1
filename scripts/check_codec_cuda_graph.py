"""Compare CUDA-graph decode with eager decode on a GPU; prints JSON.

For every dtype and a spread of lengths (several per bucket, plus one past the largest bucket
that must fall back to eager), reports the max abs difference graph vs eager, and in float32 the
max abs error against the reference waveform. Without CUDA it says so and exits 0.

    .venv/bin/python scripts/check_codec_cuda_graph.py [--tokenizer DIR] [--full-size]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import TINY_A

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (1, 4, 5, 7, 12, 13, 37, 64, 101, 200, 256, 300)
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def compare(tokenizer_dir: Path, dtype: str) -> dict:
    from safetensors.torch import load_file

    from mimo_tts.codec import load_audio_tokenizer

    eager = load_audio_tokenizer(tokenizer_dir, device="cuda", dtype=dtype)
    graphed = load_audio_tokenizer(tokenizer_dir, device="cuda", dtype=dtype, cuda_graph=True)
    generator = torch.Generator().manual_seed(0)
    sizes = eager.config.codebook_size[:8]
    rows, worst = [], 0.0
    for frames in LENGTHS:
        codes = torch.stack([torch.randint(0, s, (frames,), generator=generator) for s in sizes])
        a, b = eager.decode(codes), graphed.decode(codes)
        diff = (a - b).abs().max().item()
        worst = max(worst, diff)
        rows.append({"frames": frames, "max_abs_diff": diff,
                     "samples_ok": b.numel() == 960 * frames,
                     "finite": bool(torch.isfinite(b).all())})
    sound = all(r["samples_ok"] and r["finite"] for r in rows)
    result = {"dtype": dtype, "lengths": rows, "worst": worst,
              "ok": worst <= TOLERANCE[dtype] and sound,
              "buckets_captured": sorted(graphed._graphs._graphs) if graphed._graphs else []}
    if dtype == "float32":
        cases = load_file(str(tokenizer_dir.parent / "cases" / "codec_decode.safetensors"))
        ref = {t: (graphed.decode(cases[f"decode_T{t}.codes"]).cpu()
                   - cases[f"decode_T{t}.waveform"]).abs().max().item() for t in (4, 37, 101)}
        result["reference_error"] = ref
        result["ok"] = result["ok"] and max(ref.values()) <= 1e-4
    return result


def full_size_timing(frames: int = 250) -> dict:
    """Eager vs graph decode time of the full-size decoder with random weights (bfloat16)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_codec import CONFIG, random_model

    from mimo_tts.codec.config import CodecConfig
    from mimo_tts.codec.load import place_model
    from mimo_tts.codec.tokenizer import AudioTokenizer

    config = CodecConfig.from_json(json.loads(CONFIG.read_text()))
    model = place_model(random_model(config), torch.device("cuda"), torch.bfloat16)
    out = {}
    codes = torch.randint(0, 128, (8, frames))
    for graph in (False, True):
        tok = AudioTokenizer(model, "cuda", torch.bfloat16, cuda_graph=graph)
        tok.decode(codes)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            tok.decode(codes)
        torch.cuda.synchronize()
        out["graph" if graph else "eager"] = round((time.perf_counter() - start) / 5, 4)
    return {"frames": frames, "seconds": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=TINY_A / "tokenizer")
    parser.add_argument("--full-size", action="store_true", help="also time a full-size decoder")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"check": "codec_cuda_graph", "cuda": False, "message": "no CUDA"}))
        return 0
    results = [compare(args.tokenizer, dtype) for dtype in ("float32", "bfloat16")]
    report = {"check": "codec_cuda_graph", "cuda": True, "device": torch.cuda.get_device_name(),
              "results": results, "ok": all(r["ok"] for r in results)}
    if args.full_size:
        report["full_size"] = full_size_timing()
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
