"""The stream schedule and the server's pushed-together Stage-1 on a device; prints JSON.

Two checks on the tiny-a audio tokenizer (fixtures), float32, in incremental mode:

- `schedule`: one stream of random codes pushed as `--stream` pushes it now (the decoder's
  look-ahead plus 1 group, then 2, 4, 8, 10 groups), as before issue 24 (5 groups, then 10) and
  frame by frame: the same length, max abs difference to the old pushes, whether it is exact;
  the frame on which the first audio leaves against `StreamingDecoder.first_audio_frames`.
- `together`: streams of different lengths joining at different rounds, pushed together in
  rounds (`codec.push_streams`, as `mimo-tts serve` decodes them) against each alone: max abs
  difference and exactness per stream, and the seconds of all rounds against the same pushes
  one stream at a time.

`ok` holds when every difference is within TOLERANCE (1e-5, the codec tests' chunking
tolerance) and the first audio comes when `first_audio_frames` says. Without CUDA it says so
and exits 0 unless `--device cpu` asks for the CPU (tests/test_gpu_check.py runs it so).

    .venv/bin/python scripts/check_stream_cuda.py [--device cuda|cpu] [--streams 8]
        [--tokenizer DIR] [--threads N] [--sections schedule,together]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from _common import TINY_A

TOLERANCE = 1e-5
GROUP = 4  # code frames per group
SCHEDULES = {"growing": [1 * GROUP, 2 * GROUP, 4 * GROUP, 8 * GROUP, 10 * GROUP],
             "before": [5 * GROUP, 10 * GROUP], "frames": [1]}  # growing: plus the look-ahead


def schedules(codec) -> dict:
    """SCHEDULES in frames, the growing one's first push past this codec's look-ahead."""
    from mimo_tts.synthesis.streaming import lead_groups

    lead = lead_groups(codec, "incremental", GROUP) * GROUP
    return {**SCHEDULES, "growing": [lead + SCHEDULES["growing"][0], *SCHEDULES["growing"][1:]]}


def cuts(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    """range(total) cut into pushes of `sizes` (the last size repeats)."""
    out, start, index = [], 0, 0
    while start < total:
        out.append((start, min(total, start + sizes[min(index, len(sizes) - 1)])))
        start, index = out[-1][1], index + 1
    return out


def stream(codec, codes, sizes) -> tuple[torch.Tensor, int | None]:
    """One stream: (its samples [S] on the CPU, the frames pushed when audio first came)."""
    from mimo_tts.codec import StreamingDecoder

    decoder, pieces, first = StreamingDecoder(codec, mode="incremental"), [], None
    for a, b in cuts(codes.shape[1], sizes):
        wave = decoder.push(codes[:, a:b], last=b == codes.shape[1])
        if wave is not None:
            first = first or b
            pieces.append(wave.float().cpu())
    return torch.cat(pieces), first


def check_schedule(codec, codes) -> dict:
    from mimo_tts.codec import StreamingDecoder

    waves = {name: stream(codec, codes, sizes) for name, sizes in schedules(codec).items()}
    reference = waves["before"][0]
    expected = StreamingDecoder(codec, mode="incremental").first_audio_frames
    out = {"frames": codes.shape[1], "first_audio_frames": expected}
    for name, (wave, first) in waves.items():
        out[name] = {"samples": wave.numel(), "first_audio_at_frame": first,
                     "max_abs_vs_before": (wave - reference).abs().max().item(),
                     "equal_to_before": bool(torch.equal(wave, reference))}
    out["ok"] = waves["frames"][1] == expected and all(
        v["samples"] == reference.numel() and v["max_abs_vs_before"] <= TOLERANCE
        for k, v in out.items() if k in SCHEDULES)
    return out


def rounds(codec, codes_list, starts, together: bool) -> tuple[list[torch.Tensor], float]:
    """The server's rounds: each live stream's next push, in one call (or one by one)."""
    from mimo_tts.codec import StreamingDecoder, push_streams

    decoders = [StreamingDecoder(codec, mode="incremental") for _ in codes_list]
    plans = [cuts(c.shape[1], schedules(codec)["growing"]) for c in codes_list]
    outs: list[list] = [[] for _ in codes_list]
    busy, round_ = 0.0, 0
    while any(plans):
        live = [i for i, plan in enumerate(plans) if plan and starts[i] <= round_]
        round_ += 1
        pushes = [(i, *plans[i].pop(0)) for i in live]
        groups = [pushes] if together else [[p] for p in pushes]
        for group in groups:
            if not group:
                continue
            start = time.perf_counter()
            waves = push_streams([decoders[i] for i, _, _ in group],
                                 [codes_list[i][:, a:b] for i, a, b in group],
                                 [b == codes_list[i].shape[1] for i, _, b in group])
            if codec.device.type == "cuda":
                torch.cuda.synchronize()
            busy += time.perf_counter() - start
            for (i, _, _), wave in zip(group, waves, strict=True):
                if wave is not None:
                    outs[i].append(wave.float().cpu())
    return [torch.cat(o) for o in outs], busy


def check_together(codec, streams: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    codes_list = [torch.randint(0, 128, (8, 60 + 23 * i), generator=generator)
                  for i in range(streams)]
    starts = [i % 3 for i in range(streams)]
    rounds(codec, codes_list[:2], [0, 0], True)  # warm-up (kernels, allocator)
    solo, solo_s = rounds(codec, codes_list, starts, together=False)
    joint, joint_s = rounds(codec, codes_list, starts, together=True)
    diffs = [(a - b).abs().max().item() for a, b in zip(joint, solo, strict=True)]
    same = [a.shape == b.shape for a, b in zip(joint, solo, strict=True)]
    return {"streams": streams, "max_abs_vs_solo": max(diffs),
            "equal_to_solo": [bool(torch.equal(a, b)) for a, b in zip(joint, solo, strict=True)],
            "one_at_a_time_s": round(solo_s, 4), "together_s": round(joint_s, 4),
            "speedup": round(solo_s / joint_s, 3) if joint_s else None,
            "ok": all(same) and max(diffs) <= TOLERANCE}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else "cpu"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info
                         if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokenizer", type=Path, default=TINY_A / "tokenizer",
                        help="an audio tokenizer directory (default: tiny-a's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--sections", default="schedule,together",
                        help="comma-separated: schedule, together")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA device: nothing checked"}))
        return 0
    from mimo_tts.codec import load_audio_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    codec = load_audio_tokenizer(args.tokenizer, device=args.device, dtype="float32")
    codes = torch.randint(0, 128, (8, 241), generator=torch.Generator().manual_seed(0))
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_name(),
              "tokenizer": str(args.tokenizer), "threads": torch.get_num_threads()}
    sections = args.sections.split(",")
    if "schedule" in sections:
        report["schedule"] = check_schedule(codec, codes)
    if "together" in sections:
        report["together"] = check_together(codec, args.streams)
    report["ok"] = all(report[name]["ok"] for name in sections)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
