"""The float32 tokenizer with its linears packed against plain, in one process, in turns; JSON.

    flock /tmp/mimo-bench.lock .venv/bin/python scripts/bench_codec_packing.py
        [--tokenizer .bench/full-size/tokenizer] [--engine onednn] [--rounds 6]

Loads one tokenizer checkpoint twice: plain float32 weights (as mapped) and packed by
`--engine` ("onednn": oneDNN's blocked layout; "bf16x3": the AMX GEMM, where it runs), both
through `load_audio_tokenizer`, so the packed load includes what it packs at load (the
vocoder's layers; the decoder's too for bf16x3); the encoder and (onednn) the decoder pack
once they have run on ENCODER_PACK_AFTER_S and DECODER_PACK_AFTER_S of audio, here right after
the load, each timed on its own. Then, per op and length, both models' first call and
`--rounds` alternating calls (plain, packed, packed, plain, ...), best and median;
`plain_over_packed` is the ratio of the medians. The outputs are compared byte for byte
(`max_abs`, `codes_equal`). Decode takes 8 codebooks of random codes, encode random audio. The
page cache is warmed by reading the checkpoint once first, so the load times compare packing
with mapping, not disk.
Both models are resident together: about 2x the float32 weights (10 GB at full size).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import REPO

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _warm(directory: Path) -> None:
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(REPO / ".bench" / "full-size" / "tokenizer"))
    ap.add_argument("--engine", default="onednn", choices=("onednn", "bf16x3"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-seconds", default="3.36,10")
    ap.add_argument("--encode-seconds", default="10")
    args = ap.parse_args()

    import torch

    from mimo_tts.codec import gemm, load_audio_tokenizer
    from mimo_tts.runtime.devices import cpu_flags, cpuinfo_line

    torch.set_num_threads(args.threads)
    if args.engine == "bf16x3" and gemm.library() is None:
        sys.exit(f"bf16x3: {gemm._build()[1]}")
    if args.engine == "onednn" and gemm.onednn_packs():
        sys.exit(f"onednn: {gemm.onednn_packs()}")
    directory = Path(args.tokenizer)
    _warm(directory)
    models, load_s = {}, {}
    for name, packing in (("plain", gemm.PLAIN),
                          ("packed", gemm.Packing(args.engine, True, "benchmark"))):
        start = time.perf_counter()
        models[name] = load_audio_tokenizer(directory, "cpu", torch.float32, packing=packing)
        load_s[name] = round(time.perf_counter() - start, 3)
    # the encoder and (oneDNN's layout) the decoder pack once they have run on
    # ENCODER_PACK_AFTER_S and DECODER_PACK_AFTER_S of audio: here, now
    load_s["packing_the_encoder"] = round(_timed(models["packed"].model.encoder.pending_pack.now),
                                          3)
    load_s["packing_the_decoder"] = round(_timed(models["packed"].pack_decoder), 3)
    config = models["plain"].model.config
    rate = config.sampling_rate
    frames_per_s = rate / config.hop_length / 4  # 25 Hz codes
    gen = torch.Generator().manual_seed(1)
    cases = []
    for seconds in (float(s) for s in args.decode_seconds.split(",") if s):
        frames = round(seconds * frames_per_s)
        codes = torch.stack([torch.randint(0, size, (frames,), generator=gen)
                             for size in config.codebook_size[:8]])
        cases.append(("decode", seconds, lambda tok, c=codes: tok.decode(c)))
    for seconds in (float(s) for s in args.encode_seconds.split(",") if s):
        audio = 0.1 * torch.randn(round(seconds * rate), generator=gen)
        cases.append(("encode", seconds, lambda tok, a=audio: tok.encode(a, rate)))
    results = []
    for op, seconds, call in cases:
        outputs, first = {}, {}
        for name, tok in models.items():
            start = time.perf_counter()
            outputs[name] = call(tok)
            first[name] = round(time.perf_counter() - start, 3)
        times: dict[str, list[float]] = {"plain": [], "packed": []}
        for index in range(args.rounds):
            order = ("plain", "packed") if index % 2 == 0 else ("packed", "plain")
            for name in order:
                times[name].append(_timed(lambda n=name, c=call: c(models[n])))
        row = {"op": op, "audio_s": seconds, "first_call_s": first,
               "best_s": {n: round(min(t), 4) for n, t in times.items()},
               "median_s": {n: round(statistics.median(t), 4) for n, t in times.items()},
               "plain_over_packed": round(statistics.median(times["plain"])
                                          / statistics.median(times["packed"]), 3)}
        if op == "decode":
            row["max_abs"] = float((outputs["plain"] - outputs["packed"]).abs().max())
        else:
            row["codes_equal"] = bool(torch.equal(outputs["plain"], outputs["packed"]))
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    flags = set(cpu_flags())
    print(json.dumps({
        "benchmark": "codec_packing", "engine": args.engine, "tokenizer": str(directory),
        "machine": {"cpu": cpuinfo_line("model name"), "isa": [f for f in ISA_FLAGS if f in flags],
                    "python": platform.python_version()},
        "torch": torch.__version__, "threads": args.threads, "rounds": args.rounds,
        "load_s": load_s, "results": results}, indent=2))


if __name__ == "__main__":
    main()
