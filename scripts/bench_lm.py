"""Benchmark the Stage-0 group step at the real width with random weights; prints JSON.

The backbone keeps the real width (hidden 4096, 32/8 heads, ffn 11008, vocab 151680) but
fewer layers (--layers) so it fits in memory; the patch encoder and decoder are full size.
Reports ms per group step split into backbone (+ lm_head), patch decoder (11 steps) and patch
encoder, batch 1 vs batch B throughput, and the memory-bandwidth floor: the weight bytes one
batch-1 step must read divided by the measured copy bandwidth.

    .venv/bin/python scripts/bench_lm.py [--quick] [--layers 4] [--batch 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from mimo_tts.lm.config import LMConfig
from mimo_tts.lm.generate import GenerationOptions, decode_patch, prefill, stream
from mimo_tts.lm.model import KVCache, MiMoAudioLM
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.text import SpecialTokens

FIXTURES = Path(os.environ.get("MIMO_TTS_FIXTURES",
                               Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
FULL_CONFIG = FIXTURES / "full-size" / "lm-config.json"
# Published ids (spec §5); only `empty` and the stop tokens matter here.
SPECIAL = SpecialTokens(endoftext=151643, im_start=151644, im_end=151645, sosp=151665,
                        eosp=151666, empty=151667, sostm=151670, eostm=151671, eot=151672,
                        think=151668, end_think=151669, eos=151645, pad=151643)


def build_model(layers: int, device: str, dtype: torch.dtype) -> MiMoAudioLM:
    """The full-size architecture with `layers` backbone layers and random weights."""
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
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, repeats: int, device: str, best: bool = False) -> float:
    """Median (or best) seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times) if best else sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, mib: int, repeats: int) -> float:
    """Bytes moved per second (read + write) by a large tensor copy."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    # Best of several: other jobs on a shared machine only ever slow a copy down.
    seconds = timed(lambda: dst.copy_(src), repeats, device, best=True)
    return 2 * src.numel() / seconds


def weight_bytes_per_step(model: MiMoAudioLM) -> dict[str, int]:
    """Weight bytes one batch-1 audio step reads (embedding rows are negligible)."""
    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    cfg = model.cfg
    heads = sum(size(h) for h in model.local_transformer_lm_heads) * cfg.group_size
    return {
        "backbone": size(model.model.layers) + size(model.model.norm) + size(model.lm_head),
        "patch_decoder": size(model.hidden_states_downcast) + heads
        + cfg.local_steps * (size(model.local_transformer)),
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
def component_times(model, batch: int, repeats: int, device: str) -> dict[str, float]:
    """Seconds per group for each part of one decode step at this batch size."""
    cfg = model.cfg
    prompts = [audio_prompt(model, 48, seed) for seed in range(batch)]
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


def full_step_seconds(model, batch: int, steps: int, device: str) -> float:
    """Seconds per generated group through `stream`, every group an audio group."""
    prompts = [audio_prompt(model, 48, seed) for seed in range(batch)]

    def force_empty(step, logits):
        logits = logits.clone()
        logits[:, SPECIAL.empty] = 1e4
        return logits

    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                max_new_groups=steps + 1, text_logits_processor=force_empty)
    marks = []
    for out in stream(model, prompts, options, SPECIAL):
        if out.index == 0:
            sync(device)
            marks.append(time.perf_counter())
    # Intervals between consecutive groups exclude the prefill.
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return sorted(gaps)[len(gaps) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, few repeats")
    parser.add_argument("--layers", type=int, default=None, help="backbone layers (default 4)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's); on a CPU shared with other jobs "
                             "1 thread avoids OpenMP threads spinning against each other")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = args.layers or (2 if args.quick else 4)
    repeats, steps = (2, 3) if args.quick else (5, 8)
    dtype = getattr(torch, args.dtype)
    model = build_model(layers, args.device, dtype)
    bandwidth = copy_bandwidth(args.device, 1024, 5)
    weights = weight_bytes_per_step(model)
    parts = {b: component_times(model, b, repeats, args.device) for b in (1, args.batch)}
    step = {b: full_step_seconds(model, b, steps, args.device) for b in (1, args.batch)}
    floor = sum(weights.values()) / bandwidth
    print(json.dumps({
        "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "backbone_layers": layers,
        "weight_gib_per_step": {k: round(v / 2**30, 3) for k, v in weights.items()},
        "copy_bandwidth_gbps": round(bandwidth / 1e9, 2),
        "floor_ms_per_group": round(1e3 * floor, 1),
        "ms_per_group_parts": {b: {k: round(1e3 * v, 1) for k, v in p.items()}
                               for b, p in parts.items()},
        "ms_per_group_step": {b: round(1e3 * s, 1) for b, s in step.items()},
        "groups_per_s": {b: round(b / s, 2) for b, s in step.items()},
        "batch1_over_floor": round(step[1] / floor, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
