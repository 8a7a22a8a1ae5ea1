"""Benchmark Stage-1 (the full-size audio tokenizer, random weights) on CPU; prints JSON.

Sections (all by default, pick with --sections):
- speed: decode 10 s of codes and encode 10 s of audio in float32 and bfloat16. Each timed run
  is preceded by a measurement of the matmul peak in the same dtype, so both see the same machine
  load; the report gives the best (and median) of N runs, the real-time factor, analytic GFLOP
  and the achieved fraction of the best measured peak.
- stream: a 60 s stream in 120-frame chunks (vllm-omni's 30 groups), float32, one thread (so CPU
  seconds measure compute whatever else runs): one-shot decode, the official scheme (250/40
  overlaps) and the incremental mode; compute relative to one-shot, time to first audio, max-abs
  and RMS distance to the one-shot audio, and the incremental state size; then both schemes again
  in the chunks `mimo-tts synth --stream` pushes (5 groups first, doubling to 10 for incremental
  and 30 for official: under "pipeline_chunks"). The same distances are measured on the tiny-a
  fixture checkpoint.
- load: peak RSS (ru_maxrss, in a fresh subprocess) while loading a full-size checkpoint written
  once to a temporary safetensors file, in float32 and bfloat16, relative to the weights' bytes.
- int8: opt-in dynamically quantised decode (int8 weights) against float32: time and error.

Speed does not depend on weight values, so weights are random (built on the meta device, then
filled in place). The machine is shared: run it on a quiet machine and read `load_average`.

    .venv/bin/python scripts/bench_codec.py [--quick] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import FULL_SIZE, TINY_A

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.load import build_model, place_model
from mimo_tts.codec.tokenizer import AudioTokenizer
from mimo_tts.codec.vocoder import periodic_hann

REPO = Path(__file__).resolve().parents[1]
CONFIG = FULL_SIZE / "tokenizer-config.json"
LM_CONFIG = FULL_SIZE / "lm-config.json"
SECTIONS = ("speed", "stream", "load", "int8")
STREAM_CHUNK = 120  # code frames per push: vllm-omni's 30 groups (spec §7.6)


def random_model(config: CodecConfig, part: str | None = None):
    """Full-size model with N(0, 0.02) weights, unit norms and the real ISTFT window.

    `part` materialises only what one direction needs (the rest stays on the meta device):
    "decoder" (with the RVQ codebooks that dequantize) or "encoder".
    """
    model = build_model(config)
    modules = {None: (model,), "decoder": (model.decoder, model.encoder.quantizer),
               "encoder": (model.encoder,)}[part]
    for module in modules:
        module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_meta:
                continue
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for layer in model.encoder.quantizer.vq.layers:
            if not layer._codebook.embed.is_meta:
                layer._codebook.embed.normal_(0.0, 0.02, generator=generator)
        if not model.decoder.vocoder.head.istft.window.is_meta:
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


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """Best measured GFLOP/s of a square matmul in `dtype` (after one warm-up)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def timed(fn, repeats: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """(best s, median s, best peak GFLOP/s): one warm-up, then peak + fn `repeats` times."""
    fn()
    times, peaks = [], []
    for _ in range(repeats):
        peaks.append(matmul_peak(dtype))
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), max(peaks)


def random_codes(c: CodecConfig, frames: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, size, (frames,), generator=generator)
                        for size in c.codebook_size[:8]])


def speed_rows(tok: AudioTokenizer, seconds: float, repeats: int, encode: bool) -> list[dict]:
    """Decode (and encode) `seconds` of audio: best-of-N RTF and the fraction of peak."""
    c = tok.config
    frames = round(seconds * c.frame_rate)
    codes = random_codes(c, frames)
    audio = 0.1 * torch.randn(frames * c.samples_per_frame,
                              generator=torch.Generator().manual_seed(2))
    jobs = [("decode", lambda: tok.decode(codes), decode_flops(c, frames))]
    if encode:
        jobs.append(("encode", lambda: tok.encode(audio, c.sampling_rate),
                     encode_flops(c, audio.numel())))
    rows = []
    for op, fn, flops in jobs:
        best, median, peak = timed(fn, repeats, tok.dtype)
        rows.append({
            "op": op, "dtype": str(tok.dtype).removeprefix("torch."), "audio_s": seconds,
            "seconds": round(best, 3), "median_seconds": round(median, 3),
            "rtf": round(best / seconds, 3), "gflop": round(flops / 1e9, 1),
            "gflops": round(flops / best / 1e9, 1), "matmul_peak_gflops": round(peak, 1),
            "fraction_of_peak": round(flops / best / 1e9 / peak, 3),
        })
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def pipeline_chunks(group_size: int, mode: str):
    """Frames per push as `mimo-tts synth --stream --stream-mode MODE` pushes them."""
    from mimo_tts.synthesis.options import SynthesisOptions
    from mimo_tts.synthesis.streaming import chunk_cap, chunk_schedule

    o = SynthesisOptions()
    cap = chunk_cap(mode, o.stream_chunk_groups, o.stream_max_chunk_groups)
    return (group_size * n for n in chunk_schedule(o.stream_chunk_groups, cap))


def run_stream(decoder, codes: torch.Tensor, chunks) -> dict:
    """Push `codes` in chunks (an int, or an iterator of frame counts); wall time, time to
    first audio, the waveform, peak state bytes."""
    pieces, first, state = [], None, 0
    sizes = iter(chunks) if not isinstance(chunks, int) else None
    start = time.perf_counter()
    cpu = time.process_time()
    offset = 0
    while offset < codes.shape[1]:
        chunk = chunks if sizes is None else next(sizes)
        piece = decoder.push(codes[:, offset:offset + chunk], last=offset + chunk >= codes.shape[1])
        offset += chunk
        if piece is not None:
            pieces.append(piece)
            first = time.perf_counter() - start if first is None else first
        if hasattr(decoder, "state_bytes"):
            state = max(state, decoder.state_bytes())
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "first_audio_s": first, "wave": torch.cat(pieces), "state_bytes": state}


def distance(wave: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (wave - reference).double()
    return {"max_abs": float(diff.abs().max()), "rms": float(diff.pow(2).mean().sqrt()),
            "reference_rms": float(reference.double().pow(2).mean().sqrt())}


def compare_streams(tok: AudioTokenizer, seconds: float, chunk: int, contexts=(),
                    pipeline: bool = False) -> dict:
    """One-shot vs the official scheme vs incremental streaming of `seconds` of random codes,
    in `chunk`-frame pushes; with `pipeline`, also both schemes in `--stream`'s growing
    chunks (under "pipeline_chunks")."""
    from mimo_tts.codec import StreamingDecoder
    from mimo_tts.codec.incremental import IncrementalDecoder

    codes = random_codes(tok.config, round(seconds * tok.config.frame_rate), seed=3)
    start, cpu = time.perf_counter(), time.process_time()
    one_shot = tok.decode(codes)
    base = {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}
    runs = [(None, "official_250_40", StreamingDecoder(tok), chunk)]
    runs += [(None, f"incremental_context_{n}", IncrementalDecoder(tok, context=n), chunk)
             for n in contexts]
    runs.append((None, "incremental", IncrementalDecoder(tok), chunk))
    out = {"stream_s": seconds, "chunk_frames": chunk,
           "one_shot_seconds": round(base["seconds"], 2)}
    if pipeline:
        group = json.loads(LM_CONFIG.read_text())["group_size"]  # frames per LM group
        out["pipeline_chunks"] = {
            f"{mode}_chunk_frames": [*itertools.islice(pipeline_chunks(group, mode), 5), "..."]
            for mode in ("official", "incremental")}
        runs += [("pipeline_chunks", "official_250_40", StreamingDecoder(tok),
                  pipeline_chunks(group, "official")),
                 ("pipeline_chunks", "incremental", IncrementalDecoder(tok),
                  pipeline_chunks(group, "incremental"))]
    for section, name, decoder, chunks in runs:
        run = run_stream(decoder, codes, chunks)
        target = out if section is None else out[section]
        target[name] = {
            "seconds": round(run["seconds"], 2),
            "compute_vs_one_shot": round(run["seconds"] / base["seconds"], 3),
            "cpu_vs_one_shot": round(run["cpu_seconds"] / base["cpu_seconds"], 3),
            "first_audio_s": round(run["first_audio_s"], 3),
            **{k: round(v, 7) for k, v in distance(run["wave"], one_shot).items()},
        }
        if run["state_bytes"]:
            target[name]["state_mib"] = round(run["state_bytes"] / 2**20, 1)
        print(json.dumps({section or "fixed_chunks": {name: target[name]}}), file=sys.stderr)
    return out


def tiny_streams(seconds: float) -> dict:
    """The same comparison on the tiny-a fixture checkpoint (its real, if tiny, weights)."""
    from mimo_tts.codec import load_audio_tokenizer

    tok = load_audio_tokenizer(TINY_A / "tokenizer")
    return compare_streams(tok, seconds, STREAM_CHUNK, pipeline=True)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_child(path: str, dtype: str) -> None:
    """Runs in a fresh process: peak RSS while loading, and after touching every weight.

    Linux carries ru_maxrss across fork+exec, so the parent must stay small (it never holds the
    model while this runs); VmHWM (this process's own high-water mark) is reported alongside.
    """
    from mimo_tts.codec import load_audio_tokenizer
    from mimo_tts.codec.layers import weight_tensors

    baseline = _status_bytes("VmRSS")
    tok = load_audio_tokenizer(path, dtype=dtype)
    loading = {"peak_rss_loading": _maxrss(), "vm_hwm_loading": _status_bytes("VmHWM")}
    tensors = weight_tensors(tok.model)  # the float32 GEMM's packed halves included
    # faults in every page (oneDNN's reordered weights are opaque, and were written at load)
    checksum = sum(float(t.float().sum()) for t in tensors if not t.is_mkldnn)
    weights = sum(t.numel() * t.element_size() for t in tensors)
    print(json.dumps({"dtype": dtype, "weights_bytes": weights, "baseline_rss": baseline,
                      **loading, "peak_rss_touched": _maxrss(),
                      "vm_hwm_touched": _status_bytes("VmHWM"),
                      "finite": math.isfinite(checksum)}))


def write_child(directory: str) -> None:
    """Runs in a fresh process: write random full-size weights as model.safetensors."""
    from safetensors.torch import save_file

    model = random_model(CodecConfig.from_json(json.loads(CONFIG.read_text())))
    (Path(directory) / "config.json").write_text(CONFIG.read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(Path(directory) / "model.safetensors"))


def _child(*args: str) -> str:
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=True).stdout


def loading_memory() -> list[dict]:
    """Write a checkpoint once (in a child), then load it in fresh children and read peak RSS."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="mimo-codec-bench-") as tmp:
        _child("--write-child", tmp)
        size = (Path(tmp) / "model.safetensors").stat().st_size
        for dtype in ("float32", "bfloat16"):
            row = json.loads(_child("--load-child", tmp, dtype).strip().splitlines()[-1])
            weights = row["weights_bytes"]
            row.update({
                "file_bytes": size,
                "peak_loading_over_weights": round(row["peak_rss_loading"] / weights, 3),
                "peak_touched_over_weights": round(row["peak_rss_touched"] / weights, 3),
                "growth_over_weights": round(
                    (row["peak_rss_touched"] - row["baseline_rss"]) / weights, 3),
            })
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def int8_decode(model, seconds: float, repeats: int) -> dict:
    """Opt-in int8 decode against float32 on the same random weights."""
    from mimo_tts.codec.int8 import quantize_int8

    c = model.config
    reference = AudioTokenizer(model, "cpu", torch.float32)
    codes = random_codes(c, round(seconds * c.frame_rate))
    expected = reference.decode(codes)
    fp32_best, _, _ = timed(lambda: reference.decode(codes), repeats, torch.float32)
    quantized = quantize_int8(reference)
    wave = quantized.decode(codes)
    best, median, _ = timed(lambda: quantized.decode(codes), repeats, torch.float32)
    return {"audio_s": seconds, "float32_seconds": round(fp32_best, 3),
            "int8_seconds": round(best, 3), "int8_median_seconds": round(median, 3),
            "rtf": round(best / seconds, 3), "speedup_vs_float32": round(fp32_best / best, 2),
            **{f"error_{k}": round(v, 6) for k, v in distance(wave, expected).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 s speed runs, one repeat, a 20 s stream")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--stream-seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--stream-threads", type=int, default=1)
    parser.add_argument("--contexts", default="", help="extra incremental contexts (frames)")
    parser.add_argument("--no-encode", action="store_true")
    parser.add_argument("--load-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--write-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        return load_child(*args.load_child)
    if args.write_child:
        return write_child(args.write_child)
    if args.quick:
        args.seconds, args.repeats, args.stream_seconds = 4.0, 1, 20.0
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    report = {"benchmark": "codec", "config": str(CONFIG), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "load_average_start": os.getloadavg()}
    report.update(run_sections(args, sections))
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


def run_sections(args, sections: set[str]) -> dict:
    """The chosen sections, ordered so each uses the weights in the dtype it needs."""
    out: dict = {}
    if "load" in sections:  # first, while this process is small (see load_child)
        out["loading"] = loading_memory()
    model = random_model(CodecConfig.from_json(json.loads(CONFIG.read_text())))
    if "int8" in sections:
        out["int8"] = int8_decode(model, args.seconds, args.repeats)
    if "stream" in sections:
        # Compute is CPU seconds: one thread makes it immune to other processes' load.
        threads = torch.get_num_threads()
        torch.set_num_threads(args.stream_threads)
        tok = AudioTokenizer(place_model(model, torch.device("cpu"), torch.float32), "cpu",
                             torch.float32)
        contexts = [int(n) for n in args.contexts.split(",") if n]
        out["stream"] = compare_streams(tok, args.stream_seconds, STREAM_CHUNK, contexts,
                                        pipeline=True)
        out["stream"]["threads"] = args.stream_threads
        out["stream_tiny_a"] = tiny_streams(args.stream_seconds)
        torch.set_num_threads(threads)
    if "speed" in sections:
        out["results"] = []
        for dtype in (torch.float32, torch.bfloat16):
            tok = AudioTokenizer(place_model(model, torch.device("cpu"), dtype), "cpu", dtype)
            out["results"] += speed_rows(tok, args.seconds, args.repeats, not args.no_encode)
    return out


if __name__ == "__main__":
    main()
