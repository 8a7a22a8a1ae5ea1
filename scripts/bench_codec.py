"""Benchmark the full-size audio tokenizer on CPU with random weights; prints JSON.

Decodes 10 s of codes (250 frames) in float32 and bfloat16, and encodes 10 s of audio, reporting
seconds, real-time factor, achieved GFLOP/s (FLOPs counted analytically) and the machine's measured
matmul peak for the same dtype. Speed does not depend on weight values, so weights are random
(built on the meta device, then filled in place: no slow nn.init).

    .venv/bin/python scripts/bench_codec.py [--quick] [--seconds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.load import build_model, place_model
from mimo_tts.codec.tokenizer import AudioTokenizer
from mimo_tts.codec.vocoder import periodic_hann

REPO = Path(__file__).resolve().parents[1]
FULL_SIZE = Path(os.environ.get("MIMO_TTS_FIXTURES", REPO.parent / "shared" / "fixtures"))
CONFIG = FULL_SIZE / "full-size" / "tokenizer-config.json"


def random_model(config: CodecConfig):
    """Full-size model with N(0, 0.02) weights, unit norms and the real ISTFT window."""
    model = build_model(config).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for layer in model.encoder.quantizer.vq.layers:
            layer._codebook.embed.normal_(0.0, 0.02, generator=generator)
        model.decoder.vocoder.head.istft.window.copy_(periodic_hann(config.nfft))
    return model


def _layers_flops(tokens: int, dim: int, ffn: int, layers: int, keys_per_query: float) -> float:
    """Multiply-adds x2 of a transformer stack: projections, FFN and the attention matmuls."""
    dense = 2 * tokens * (4 * dim * dim + 2 * dim * ffn)
    attention = 2 * 2 * tokens * keys_per_query * dim
    return layers * (dense + attention)


def decode_flops(c: CodecConfig, frames: int) -> float:
    latent, n = frames * c.avg_pooler, frames * c.mel_frames_per_code
    window = sum(c.vocoder_attn_window_size) + 1
    flops = 2 * frames * c.d_model * c.d_model * c.avg_pooler  # dconv1
    flops += _layers_flops(latent, c.d_model, c.decoder_ffn_dim, c.decoder_layers, latent / 2)
    flops += 2 * latent * c.d_model * c.n_mels * c.decoder_kernel_size  # dconv2
    flops += 2 * n * c.n_mels * c.vocoder_dim  # embeddings
    flops += _layers_flops(n, c.vocoder_dim, c.vocoder_intermediate_dim, c.vocoder_num_layers,
                           min(window, n))
    flops += 2 * n * c.vocoder_dim * (c.nfft + 2)  # head
    flops += n * 5 * c.nfft * math.log2(c.nfft)  # irfft, the usual 5 N log N estimate
    return flops


def encode_flops(c: CodecConfig, samples: int) -> float:
    mel = 1 + samples // c.hop_length
    latent = -(-mel // c.stride_size)
    frames = -(-latent // c.avg_pooler)
    flops = 2 * mel * c.n_mels * c.d_model * c.kernel_size  # conv1
    flops += 2 * latent * c.d_model * c.d_model * c.kernel_size  # conv2
    flops += _layers_flops(latent, c.d_model, c.encoder_ffn_dim, c.encoder_layers, latent)
    flops += 2 * frames * c.d_model * c.d_model * c.avg_pooler  # down-sampling conv
    flops += 2 * frames * c.d_model * sum(c.codebook_size)  # RVQ distances
    return flops


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Measured GFLOP/s of a large square matmul in `dtype`."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


def timed(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(tok: AudioTokenizer, seconds: float, repeats: int, encode: bool) -> list[dict]:
    c = tok.config
    frames = round(seconds * c.frame_rate)
    samples = frames * c.samples_per_frame
    generator = torch.Generator().manual_seed(1)
    codes = torch.stack([torch.randint(0, size, (frames,), generator=generator)
                         for size in c.codebook_size[:8]])
    audio = 0.1 * torch.randn(samples, generator=generator)
    jobs = [("decode", lambda: tok.decode(codes), decode_flops(c, frames))]
    if encode:
        jobs.append(("encode", lambda: tok.encode(audio, c.sampling_rate),
                     encode_flops(c, samples)))
    peak = matmul_peak(tok.dtype)
    rows = []
    for op, fn, flops in jobs:
        secs = timed(fn, repeats)
        rows.append({
            "op": op, "dtype": str(tok.dtype).removeprefix("torch."), "audio_s": seconds,
            "seconds": round(secs, 3), "rtf": round(secs / seconds, 3),
            "gflop": round(flops / 1e9, 1), "gflops": round(flops / secs / 1e9, 1),
            "matmul_peak_gflops": round(peak, 1),
            "fraction_of_peak": round(flops / secs / 1e9 / peak, 3),
        })
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 s of audio, one timed run")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-encode", action="store_true")
    args = parser.parse_args()
    seconds, repeats = (4.0, 1) if args.quick else (args.seconds, args.repeats)
    torch.set_num_threads(args.threads)
    config = CodecConfig.from_json(json.loads(CONFIG.read_text()))
    model = random_model(config)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        tok = AudioTokenizer(place_model(model, torch.device("cpu"), dtype), "cpu", dtype)
        results += measure(tok, seconds, repeats, encode=not args.no_encode)
    print(json.dumps({
        "benchmark": "codec", "config": str(CONFIG), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
