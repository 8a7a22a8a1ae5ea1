"""Benchmark the Stage-0 group step at the real width with random weights; prints JSON.

The backbone keeps the real width (hidden 4096, 32/8 heads, ffn 11008, vocab 151680) but
fewer layers (--layers) so it fits in memory; the patch encoder (6 layers) and decoder
(16 layers, 11 steps per group) are full size. Weights are fused and the patch decoder's
steps run through the fused CPU kernel (mimo_tts/lm/cpu_kernel.py) where `load_lm` would use
it (--no-fuse, --kernel off to compare).

Reported, all from one run:
- ms per group step split into backbone (+ lm_head), patch decoder (11 steps) and patch
  encoder, and the whole step through `stream`, for each batch size (default 1, 4, 8);
- groups/s per batch size and the batch-B / batch-1 throughput ratios;
- the memory-bandwidth floor of a batch-1 step: the weight bytes one step must read divided
  by the read bandwidth: the best bytes per second of two large read-only operations (a sum
  and a bf16 matrix-vector product, each over 1 GiB, far more than the last-level cache),
  best of several; the tensor copy bandwidth (read + write bytes) is reported for reference.

The CPU is shared with other jobs, so every time is the best of N after a warm-up (others
only ever slow a run down), each timed call first waits (up to --quiet-wait seconds) for the
other jobs' CPU use to drop below --quiet-busy, the bandwidth is sampled between the step
measurements in the same way, and the calls that found no quiet moment are counted.

    .venv/bin/python scripts/bench_lm.py [--quick] [--layers 4] [--batch 1,4,8] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from _common import FULL_SIZE, cpu_ticks

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.config import LMConfig
from mimo_tts.lm.generate import GenerationOptions, decode_patch, prefill, stream
from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.text import SpecialTokens

FULL_CONFIG = FULL_SIZE / "lm-config.json"
# Published ids (spec §5); only `empty` and the stop tokens matter here.
SPECIAL = SpecialTokens(endoftext=151643, im_start=151644, im_end=151645, sosp=151665,
                        eosp=151666, empty=151667, sostm=151670, eostm=151671, eot=151672,
                        think=151668, end_think=151669, eos=151645, pad=151643)
PROMPT_GROUPS = 48


def build_model(layers: int, device: str, dtype: torch.dtype, fuse: bool = True,
                kernel: str = "auto") -> MiMoAudioLM:
    """The full-size architecture with `layers` backbone layers and random weights, fused and
    with the CPU patch-decoder kernel as `load_lm` sets them up."""
    cfg = json.loads(FULL_CONFIG.read_text())
    cfg["num_hidden_layers"] = layers
    with torch.device("meta"):
        model = MiMoAudioLM(LMConfig.from_json(cfg))
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:  # uniform with std 0.02: fast to draw, keeps activations sane
                p.uniform_(-0.0346, 0.0346, generator=gen)
    model.build_buffers(torch.device(device))
    if fuse:
        model.fuse_weights()
        model.use_cpu_kernel(kernel)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Quiet:
    """Waits for other processes' CPU use (from /proc/stat, while this one sleeps) to fall
    below `busy`, at most `wait` seconds; counts the waits that timed out."""

    def __init__(self, wait: float, busy: float):
        self.wait, self.busy = wait, busy
        self.calls = self.noisy = 0

    def __call__(self) -> None:
        if self.wait <= 0 or not os.path.exists("/proc/stat"):
            return
        self.calls += 1
        deadline = time.monotonic() + self.wait
        while time.monotonic() < deadline:
            busy, total = cpu_ticks()
            time.sleep(0.2)
            busy2, total2 = cpu_ticks()
            if (busy2 - busy) / max(1, total2 - total) < self.busy:
                return
        self.noisy += 1


QUIET = Quiet(0, 1.0)


def timed(fn, repeats: int, device: str) -> list[float]:
    """Seconds of each of `repeats` calls of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        QUIET()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


class Bandwidth:
    """Read bandwidth samples: bytes per second of two large read-only operations, PyTorch's
    sum over an int64 tensor and its matrix-vector product with a bfloat16 matrix (the
    kernel the eager path uses), each over `mib` MiB, far more than the last-level cache."""

    OPS = ("sum of a 1 GiB int64 tensor", "torch.mv of a 1 GiB bfloat16 matrix")

    def __init__(self, device: str, mib: int):
        self.device = device
        self.src = torch.ones(mib * 2**20 // 8, dtype=torch.int64, device=device)
        self.matrix = torch.full((mib * 2**19 // 4096, 4096), 0.5, dtype=torch.bfloat16,
                                 device=device)
        self.vector = torch.ones(4096, dtype=torch.bfloat16, device=device)
        self.read: dict[str, list[float]] = {op: [] for op in self.OPS}

    def sample(self, repeats: int = 2) -> None:
        nbytes = self.src.numel() * self.src.element_size()
        ops = (self.src.sum, lambda: torch.mv(self.matrix, self.vector))
        for op, fn in zip(self.OPS, ops, strict=True):
            self.read[op] += [nbytes / s for s in timed(fn, repeats, self.device)]

    def best(self) -> float:
        return max(max(v) for v in self.read.values())

    def copy(self, repeats: int) -> float:
        """Bytes moved per second (read + write) by a tensor copy, best of `repeats`."""
        dst = torch.empty_like(self.src)
        best = min(timed(lambda: dst.copy_(self.src), repeats, self.device))
        return 2 * self.src.numel() * self.src.element_size() / best


def weight_bytes_per_step(model: MiMoAudioLM) -> dict[str, int]:
    """Weight bytes one batch-1 audio step reads (embedding rows are negligible)."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    cfg = model.cfg
    # Each channel's head is read at the F steps that sample it.
    heads = size(model.local_transformer_lm_heads) * cfg.group_size
    return {
        "backbone": size(model.model.layers) + size(model.model.norm) + size(model.lm_head),
        "patch_decoder": size(model.hidden_states_downcast) + heads
        + cfg.local_steps * size(model.local_transformer),
        "patch_encoder": size(model.input_local_transformer) + size(model.speech_group_downcast),
    }


def audio_prompt(model: MiMoAudioLM, groups: int, seed: int) -> torch.Tensor:
    """A prompt [9, 4G] of text groups followed by 8 audio groups."""
    cfg, gen = model.cfg, torch.Generator().manual_seed(seed)
    frames, k = cfg.group_size, cfg.audio_channels
    ids = torch.tensor([0] + list(cfg.speech_empty_ids)).repeat_interleave(frames * groups)
    ids = ids.view(1 + k, frames * groups).clone()
    ids[0] = torch.randint(0, 151000, (frames * groups,), generator=gen)
    audio = slice(frames * (groups - 8), frames * groups)
    ids[0, audio] = SPECIAL.empty
    for c, n in enumerate(cfg.speech_empty_ids):
        ids[1 + c, audio] = torch.randint(0, n, (frames * 8,), generator=gen)
    return ids


@torch.inference_mode()
def component_times(model, batch: int, repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per group (each repeat) for each part of one decode step at this batch size."""
    cfg = model.cfg
    prompts = [audio_prompt(model, PROMPT_GROUPS, seed) for seed in range(batch)]
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=64)
    state = prefill(model, prompts, options, SPECIAL)
    slot = state.prompt_len
    embeds = state.hidden.unsqueeze(1)
    positions = state.lengths

    def backbone():
        hidden = model.backbone(embeds, positions, state.cache, slot, slot + 1)[:, -1]
        return model.text_logits(hidden)

    local_in = model.hidden_states_downcast(state.hidden)
    local = KVCache(cfg.patch_decoder, batch, cfg.local_steps, dtype=embeds.dtype, device=device)
    codes = decode_patch(model, local_in, GREEDY, None, local)
    tokens = torch.full((batch, 1), SPECIAL.empty, device=device)
    return {
        "backbone": timed(backbone, repeats, device),
        "patch_decoder": timed(lambda: decode_patch(model, local_in, GREEDY, None, local),
                               repeats, device),
        "patch_encoder": timed(lambda: model.embed_groups(tokens, codes[:, None], SPECIAL.empty),
                               repeats, device),
    }


def step_times(model, batch: int, steps: int, device: str) -> list[float]:
    """Seconds between consecutive groups yielded by `stream`, every group an audio group."""
    prompts = [audio_prompt(model, PROMPT_GROUPS, seed) for seed in range(batch)]

    def force_empty(step, logits):
        logits = logits.clone()
        logits[:, SPECIAL.empty] = 1e4
        return logits

    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                max_new_groups=steps + 2, text_logits_processor=force_empty)
    gaps, last = [], None
    for out in stream(model, prompts, options, SPECIAL):
        if out.index == 0:
            sync(device)
            if last is not None:
                gaps.append(time.perf_counter() - last)
            QUIET()  # the generator is paused here: the next group starts when resumed
            last = time.perf_counter()
    # Each interval is one group's step; the prefill is excluded and the first is a warm-up.
    return gaps[1:]


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    middle = ordered[len(ordered) // 2]
    return {"best": round(1e3 * ordered[0], 1), "median": round(1e3 * middle, 1)}


def run(args) -> dict:
    layers = args.layers or (2 if args.quick else 4)
    repeats, steps = (2, 3) if args.quick else (5, 8)
    batches = [int(b) for b in args.batch.split(",")]
    if 1 not in batches:
        batches.insert(0, 1)
    load_before = os.getloadavg()
    model = build_model(layers, args.device, getattr(torch, args.dtype), fuse=not args.no_fuse,
                        kernel=args.kernel)
    bandwidth = Bandwidth(args.device, 1024)
    weights = weight_bytes_per_step(model)
    parts, steps_s = {}, {}
    for b in batches:
        bandwidth.sample()
        parts[b] = component_times(model, b, repeats, args.device)
        bandwidth.sample()
        steps_s[b] = step_times(model, b, steps, args.device)
    bandwidth.sample()
    read_bw = bandwidth.best()
    floor = sum(weights.values()) / read_bw
    best = {b: min(s) for b, s in steps_s.items()}
    return {
        "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "load_average_start_end": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "timed_calls_without_quiet_cpu": f"{QUIET.noisy} of {QUIET.calls}",
        "backbone_layers": layers, "fused_weights": not args.no_fuse,
        "cpu_kernel": {"active": model.local_transformer.kernel is not None,
                       **cpu_kernel.features()},
        "weight_gib_per_step": {k: round(v / 2**30, 3) for k, v in weights.items()},
        "read_bandwidth_gbps": {
            op: {"best": round(max(v) / 1e9, 2), "median": round(sorted(v)[len(v) // 2] / 1e9, 2)}
            for op, v in bandwidth.read.items()},
        "floor_bandwidth_gbps": round(read_bw / 1e9, 2),
        "copy_bandwidth_gbps_read_plus_write": round(bandwidth.copy(3) / 1e9, 2),
        "floor_ms_per_group": round(1e3 * floor, 1),
        "floor_ms_parts": {k: round(1e3 * v / read_bw, 1) for k, v in weights.items()},
        "ms_per_group_parts": {b: {k: _ms(v) for k, v in p.items()} for b, p in parts.items()},
        "ms_per_group_step": {b: _ms(s) for b, s in steps_s.items()},
        "groups_per_s": {b: round(b / s, 2) for b, s in best.items()},
        "throughput_over_batch1": {b: round(b * best[1] / s, 2) for b, s in best.items()},
        "batch1_over_floor": round(best[1] / floor, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, few repeats")
    parser.add_argument("--layers", type=int, default=None, help="backbone layers (default 4)")
    parser.add_argument("--batch", default="1,4,8", help="batch sizes, comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads (default: all the machine's cores)")
    parser.add_argument("--quiet-wait", type=float, default=3.0,
                        help="seconds to wait, before each timed call, for the CPU to be quiet "
                             "(0: never wait)")
    parser.add_argument("--quiet-busy", type=float, default=0.1,
                        help="CPU use by other processes (0-1) below which the CPU is quiet")
    parser.add_argument("--no-fuse", action="store_true",
                        help="keep q/k/v, gate/up and the channel heads as separate matmuls")
    parser.add_argument("--kernel", choices=("auto", "on", "off"), default="auto",
                        help="the fused CPU patch-decoder kernel: where faster (auto), always, "
                             "or never (eager steps)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    QUIET.wait, QUIET.busy = args.quiet_wait, args.quiet_busy
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
