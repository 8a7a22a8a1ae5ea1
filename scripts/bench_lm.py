"""Benchmark the Stage-0 group step at the real width with random weights; prints JSON.

The backbone keeps the real width (hidden 4096, 32/8 heads, ffn 11008, vocab 151680) but
fewer layers (--layers) so it fits in memory; the patch encoder (6 layers) and decoder
(16 layers, 11 steps per group) are full size (the token embedding, of which a step reads a
few rows, is one row repeated, to save 1.2 GB). Weights are fused. Each decode step is
measured both ways, back to back: "eager" (mimo_tts.lm.step.EagerStep on the weights as
loaded, row-major), then, after the weights are packed as `load_lm` packs them
(`cpu_kernel.prepare`: 16-row blocks on huge pages, in place), "kernel"
(cpu_kernel.CpuKernelStep: every product and the patch decoder's positions in the fused C
kernel), the latter where `--kernel` (auto: as `load_lm` decides; on; off: eager only) lets
it run.

Reported, all from one run:
- ms per group step split into backbone (+ lm_head), patch decoder (11 steps) and patch
  encoder, each beside its bandwidth floor, and the whole step through `stream`, for each
  batch size (default 1, 4, 8) and each step kind;
- groups/s per batch size and the batch-B / batch-1 throughput ratios;
- the arithmetic ceiling of the kernel's products at each batch size: GB/s of packed weight
  they multiply by B rows with the weight in cache (`products_in_cache_gbps`), the bound it
  puts on a batch-B step (its weight bytes over the slower of that and the read bandwidth) and
  the best batch-B / batch-1 throughput ratio that bound leaves beside the measured batch 1
  (`throughput_over_batch1_at_most`: products only, nothing else of the step counted);
- the memory-bandwidth floor of a batch-1 step: the weight bytes one step must read divided
  by the read bandwidth: the best bytes per second of three large read-only operations (a sum
  on ordinary pages, the same sum on huge pages, and a bf16 matrix-vector product, each over
  --bandwidth-mib, far more than the last-level cache), best of several; the tensor copy
  bandwidth (read + write bytes) is reported for reference. Beside the step over that floor
  (`batch1_over_floor`), each round's best step over the floor at the read sampled just
  before it (`batch1_over_floor_same_moment`, sorted): the machine's bandwidth can move
  between the best read of a run and its steps.

With --anchor, the step's product shapes alone (one backbone layer's four, lm_head and the
patch decoder's four) at 1 and 8 rows: GB/s of weight bytes through the kernel's packed
products and through AMD's zentorch linear on weights it prepacked (`--anchor zentorch`, where
it imports; said so where not), in the same run, alternating, each over a pool of matrices far
larger than the last-level cache.

The CPU is shared with other jobs, so every time is the best of N after a warm-up (others
only ever slow a run down), each timed call first waits (up to --quiet-wait seconds) for the
other jobs' CPU use to drop below --quiet-busy, the bandwidth is sampled between the step
measurements in the same way, and the calls that found no quiet moment are counted.

With --quant w8a8 (or w4a8) --quant-only, the model is packed as `load_lm(quant=...)` packs it
(int8 or 4-bit groups in place, one matrix at a time) and only that step is timed, over the
bfloat16 floor: the whole step at full size (--layers 36) fits in memory that way, where keeping
both forms would not.

With --prefill GROUPS, each step kind also times the prefill of one prompt of GROUPS positions
(`prefill_ms`, best and median of 3 per round): the compute-bound part of a short item, which
issue 31 asks at >= 60% of the machine's matmul peak.

With --march LEVEL (e.g. x86-64-v3: AVX2 and FMA, no AVX-512), the C kernels are built for
that x86-64 level instead of this CPU, so another kind's path (the AVX2 tiles) runs here; its
build and its measured choices (`products_faster`, ...) go to their own cache folder, so that
neither this CPU's build nor its decisions are reused. PyTorch's own kernels (the eager step,
oneDNN) still use every instruction of this CPU, so the eager times are not the other kind's.

    .venv/bin/python scripts/bench_lm.py [--quick] [--layers 4] [--batch 1,4,8] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time

import torch
from _common import FULL_SIZE, cpu_ticks

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.config import LMConfig
from mimo_tts.lm.generate import GenerationOptions, decode_patch, prefill, stream
from mimo_tts.lm.int8 import matrices, quantize_rows
from mimo_tts.lm.model import KVCache, MiMoAudioLM, unpack_rows
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.step import EagerStep
from mimo_tts.lm.text import SpecialTokens
from mimo_tts.runtime import kernels
from mimo_tts.runtime.paths import CACHE_ENV, cache_root

FULL_CONFIG = FULL_SIZE / "lm-config.json"
# Published ids (spec §5); only `empty` and the stop tokens matter here.
SPECIAL = SpecialTokens(endoftext=151643, im_start=151644, im_end=151645, sosp=151665,
                        eosp=151666, empty=151667, sostm=151670, eostm=151671, eot=151672,
                        think=151668, end_think=151669, eos=151645, pad=151643)
PROMPT_GROUPS = 48


def build_model(layers: int, device: str, dtype: torch.dtype,
                kernel: str = "auto") -> MiMoAudioLM:
    """The full-size architecture with `layers` backbone layers and random weights, fused and
    with the CPU kernel mode `kernel`, as `load_lm` sets them up."""
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
            elif name != "model.embed_tokens.weight":  # uniform, std 0.02: keeps sane values
                p.uniform_(-0.0346, 0.0346, generator=gen)
        row = torch.empty(1, model.cfg.hidden, dtype=dtype, device=device)
        model.model.embed_tokens.weight = torch.nn.Parameter(
            row.uniform_(-0.0346, 0.0346, generator=gen).expand(model.cfg.vocab_size, -1),
            requires_grad=False)
    model.build_buffers(torch.device(device))
    model.fuse_weights()
    model.cpu_kernel = kernel
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

    OPS = ("sum of an int64 tensor", "sum of an int64 tensor on huge pages",
           "torch.mv of a bfloat16 matrix")

    def __init__(self, device: str, mib: int):
        self.device = device
        self.src = torch.ones(mib * 2**20 // 8, dtype=torch.int64, device=device)
        self.huge = self.src  # the kernel's huge-page allocation, where it has one
        if device == "cpu":
            self.huge = cpu_kernel.huge_bytes(mib * 2**20).view(torch.int64).fill_(1)
        self.matrix = torch.full((mib * 2**19 // 4096, 4096), 0.5, dtype=torch.bfloat16,
                                 device=device)
        self.vector = torch.ones(4096, dtype=torch.bfloat16, device=device)
        self.read: dict[str, list[float]] = {op: [] for op in self.OPS}

    def sample(self, repeats: int = 2) -> float:
        """Time each operation `repeats` times (kept in `read`); -> this sample's best."""
        nbytes = self.src.numel() * self.src.element_size()
        ops = (self.src.sum, self.huge.sum, lambda: torch.mv(self.matrix, self.vector))
        now = []
        for op, fn in zip(self.OPS, ops, strict=True):
            now += [nbytes / s for s in timed(fn, repeats, self.device)]
            self.read[op] += now[-repeats:]
        return max(now)

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


def audio_prompt(model: MiMoAudioLM, groups: int, seed: int,
                 empty: int = SPECIAL.empty) -> torch.Tensor:
    """A prompt [9, 4G] of text groups followed by 8 audio groups (`empty`: the model's
    <|empty|> id)."""
    cfg, gen = model.cfg, torch.Generator().manual_seed(seed)
    frames, k = cfg.group_size, cfg.audio_channels
    ids = torch.tensor([0] + list(cfg.speech_empty_ids)).repeat_interleave(frames * groups)
    ids = ids.view(1 + k, frames * groups).clone()
    ids[0] = torch.randint(0, min(151000, cfg.vocab_size), (frames * groups,), generator=gen)
    audio = slice(frames * (groups - 8), frames * groups)
    ids[0, audio] = empty
    for c, n in enumerate(cfg.speech_empty_ids):
        ids[1 + c, audio] = torch.randint(0, n, (frames * 8,), generator=gen)
    return ids


STEPS = {"eager": EagerStep, "kernel": cpu_kernel.CpuKernelStep,
         "kernel_int8": cpu_kernel.CpuKernelStep, "kernel_w8a8": cpu_kernel.CpuKernelStep,
         "kernel_w4a8": cpu_kernel.CpuKernelStep}
DECODE_STEP = {"eager": "eager", "kernel": "auto", "kernel_int8": "auto", "kernel_w8a8": "auto",
               "kernel_w4a8": "auto"}
PACKED_QUANTS = ("w8a8", "w4a8")


class QuantSwap:
    """The model's matrices in two forms (--quant): `use(True)` points the blocks at the
    quantized ones, `use(False)` back at the model dtype's (packed or not), so both run from
    one model. int8: the weight-only matrices (mimo_tts/lm/int8.py `matrices`), row-major;
    w8a8 or w4a8: every streamed matrix packed as `load_lm(quant=...)` packs it."""

    def __init__(self, model: MiMoAudioLM, quant: str):
        lib = cpu_kernel.library()
        fits, packer = cpu_kernel.QUANT_PACKERS.get(quant, (None, None))
        if quant == "int8":
            self.slots = matrices(model)
        else:
            self.slots = [(o, n) for o, n, _ in model.streamed_matrices()
                          if fits(_dense(getattr(o, n)))]
        self.dense = [getattr(m, n) for m, n in self.slots]
        self.quantized = [_like(w, quantize_rows(_dense(w)) if quant == "int8"
                                else packer(lib, _dense(w),  # huge pages
                                            cpu_kernel.huge_bytes(w.numel())))
                          for w in self.dense]

    def use(self, quantized: bool) -> None:
        for (module, name), t in zip(self.slots, self.quantized if quantized else self.dense,
                                     strict=True):
            setattr(module, name, t)


def _dense(w: torch.Tensor) -> torch.Tensor:
    return unpack_rows(w) if w.dim() == 3 else w


def _like(dense: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The quantized matrix `q` as a parameter where `dense` is one (with its scales)."""
    if not isinstance(dense, torch.nn.Parameter):
        return q
    p = torch.nn.Parameter(q, requires_grad=False)
    p.scale = q.scale
    return p


@torch.inference_mode()
def component_times(model, batch: int, repeats: int, device: str,
                    kind: str) -> dict[str, list[float]]:
    """Seconds per group (each repeat) for each part of one decode step at this batch size,
    run by the step `kind` ("eager" or "kernel")."""
    cfg = model.cfg
    prompts = [audio_prompt(model, PROMPT_GROUPS, seed) for seed in range(batch)]
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=64)
    state = prefill(model, prompts, options, SPECIAL)
    local = KVCache(cfg.patch_decoder, batch, cfg.local_steps, dtype=state.hidden.dtype,
                    device=device)
    step = STEPS[kind](model, state.cache, local, state.valid)
    slot = state.prompt_len
    embeds = state.hidden.unsqueeze(1)

    def backbone():
        return step.text_logits(step.backbone(embeds, state.lengths, slot))

    local_in = model.hidden_states_downcast(state.hidden)
    codes = decode_patch(model, local_in, GREEDY, None, step)
    tokens = torch.full((batch,), SPECIAL.empty, device=device)
    return {
        "backbone": timed(backbone, repeats, device),
        "patch_decoder": timed(lambda: decode_patch(model, local_in, GREEDY, None, step),
                               repeats, device),
        "patch_encoder": timed(lambda: step.embed(tokens, codes, SPECIAL.empty),
                               repeats, device),
    }


def step_times(model, batch: int, steps: int, device: str, kind: str) -> list[float]:
    """Seconds between consecutive groups yielded by `stream`, every group an audio group."""
    prompts = [audio_prompt(model, PROMPT_GROUPS, seed) for seed in range(batch)]

    def force_empty(step, logits):
        logits = logits.clone()
        logits[:, SPECIAL.empty] = 1e4
        return logits

    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY,
                                max_new_groups=steps + 2, text_logits_processor=force_empty,
                                decode_step=DECODE_STEP[kind])
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


@torch.inference_mode()
def prefill_times(model, groups: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` prefills of one prompt of `groups` positions (the last
    8 audio groups) after a warm-up, run as the model stands (its products, packed or not)."""
    prompts = [audio_prompt(model, groups, 0)]
    options = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=1)
    prefill(model, prompts, options, SPECIAL)
    times = []
    for _ in range(repeats):
        QUIET()
        start = time.perf_counter()
        prefill(model, prompts, options, SPECIAL)
        times.append(time.perf_counter() - start)
    return times


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
    model = build_model(layers, args.device, getattr(torch, args.dtype), kernel=args.kernel)
    choice = cpu_kernel.choose(model)
    kinds = (["eager"] if args.eager else []) + (["kernel"] if choice.active else [])
    if args.quant_only:  # the model itself packed as --lm-quant w8a8/w4a8 packs it
        kinds = [k for k in kinds if k != "kernel"] + [f"kernel_{args.quant}"]
    weights = weight_bytes_per_step(model)  # bfloat16 bytes: the floor stays bfloat16's
    bandwidth = Bandwidth(args.device, args.bandwidth_mib)
    parts: dict = {}
    steps_s: dict = {}
    packing = "not packed"
    paired: dict = {}
    prefills: dict = {}
    for kind in kinds:
        swap = None
        if kind in (f"kernel_{q}" for q in PACKED_QUANTS):  # as load_lm(quant=...) leaves it
            quant = kind.removeprefix("kernel_")
            if why := cpu_kernel.packed_quant_refusal(model, quant):
                raise SystemExit(f"bench_lm: --quant-only: {why}")
            model.quant = quant
            cpu_kernel.prepare(model)
            packing = cpu_kernel.packing(model)
        if kind == "kernel":  # as load_lm leaves it: the streamed matrices packed in place
            cpu_kernel.prepare(model)
            packing = cpu_kernel.packing(model) if model.packed_bytes else packing
            swap = QuantSwap(model, args.quant) if args.quant else None
        group = [kind] + ([f"kernel_{args.quant}"] if swap is not None else [])
        for k in group:
            parts[k] = {b: {} for b in batches}
            steps_s[k] = {b: [] for b in batches}
        measure(model, batches, group, swap, bandwidth, parts, steps_s, args, repeats, steps,
                paired)
        if args.prefill:
            for k in group:
                if swap is not None:
                    swap.use(k.startswith("kernel_"))
                prefills[k] = _ms(prefill_times(model, args.prefill, 3 * args.rounds))
            if swap is not None:
                swap.use(False)
    anchor = product_anchor(model, args) if args.anchor else None
    in_cache = products_in_cache(batches) if "kernel" in kinds else {}
    bandwidth.sample()
    read_bw = bandwidth.best()
    floor = sum(weights.values()) / read_bw
    # A batch-B step's products read every weight once and multiply it by B rows: the slower
    # of the read and the tiles' in-cache rate bounds them.
    bound = {b: sum(weights.values()) / min(read_bw, rate) for b, rate in in_cache.items()}
    floor_parts = {k: v / read_bw for k, v in weights.items()}
    best = {k: {b: min(s) for b, s in per.items()} for k, per in steps_s.items()}
    return {
        "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
        "load_average_start_end": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "timed_calls_without_quiet_cpu": f"{QUIET.noisy} of {QUIET.calls}",
        "backbone_layers": layers,
        "cpu_kernel": {"mode": args.kernel, "active": choice.active, "reason": choice.reason,
                       "weights": packing, "built_for": args.march or "this CPU (native)",
                       **cpu_kernel.features()},
        "weight_gib_per_step": {k: round(v / 2**30, 3) for k, v in weights.items()},
        "read_bandwidth_gbps": {
            op: {"best": round(max(v) / 1e9, 2), "median": round(sorted(v)[len(v) // 2] / 1e9, 2)}
            for op, v in bandwidth.read.items()},
        "floor_bandwidth_gbps": round(read_bw / 1e9, 2),
        "copy_bandwidth_gbps_read_plus_write": round(bandwidth.copy(3) / 1e9, 2),
        "floor_ms_per_group": round(1e3 * floor, 1),
        "floor_ms_parts": {k: round(1e3 * v, 1) for k, v in floor_parts.items()},
        "ms_per_group_parts": {k: {b: {p: _ms(v) for p, v in per.items()}
                                   for b, per in by.items()} for k, by in parts.items()},
        "batch1_parts_over_floor": {
            k: {p: round(min(v) / floor_parts[p], 2) for p, v in by[1].items()}
            for k, by in parts.items()},
        "ms_per_group_step": {k: {b: _ms(s) for b, s in per.items()}
                              for k, per in steps_s.items()},
        "groups_per_s": {k: {b: round(b / s, 2) for b, s in per.items()}
                         for k, per in best.items()},
        "throughput_over_batch1": {k: {b: round(b * per[1] / s, 2) for b, s in per.items()}
                                   for k, per in best.items()},
        "batch1_over_floor": {k: round(per[1] / floor, 2) for k, per in best.items()},
        # Each round's best batch-1 step over the floor at the read sampled just before it:
        # this VM's memory bandwidth moves from minute to minute, and a step follows it.
        "batch1_over_floor_same_moment": {
            k: sorted(round(s * read / sum(weights.values()), 2) for s, read in per[1])
            for k, per in paired.items() if 1 in per},
        **({"kernel_speedup_step": {b: round(best["eager"][b] / s, 2)
                                    for b, s in best["kernel"].items()}}
           if "kernel" in best and "eager" in best else {}),
        **({f"{args.quant}_over_bf16_step": {b: round(s / best["kernel"][b], 2)
                                             for b, s in best[f"kernel_{args.quant}"].items()}}
           if f"kernel_{args.quant}" in best and "kernel" in best else {}),
        **({"products_gbps": anchor} if anchor is not None else {}),
        **({"prefill_groups": args.prefill, "prefill_ms": prefills} if prefills else {}),
        **({"products_in_cache_gbps": {b: round(v / 1e9, 1) for b, v in in_cache.items()},
            "products_bound_ms_per_group": {b: round(1e3 * v, 1) for b, v in bound.items()},
            "throughput_over_batch1_at_most": {
                k: {b: round(b * per[1] / v, 2) for b, v in bound.items() if b > 1}
                for k, per in best.items() if k.startswith("kernel") and 1 in per}}
           if in_cache else {}),
    }


def measure(model, batches, kinds, swap, bandwidth, parts, steps_s, args, repeats,
            steps, paired) -> None:
    """Rounds of each step kind at each batch size (the kinds alternate within a round, so
    noise hits them alike), the read bandwidth sampled before each round and again just
    before its whole steps: `paired[kind][b]` gets (the round's best step, that read)."""
    for b in batches:
        for _ in range(args.rounds):
            for kind in kinds:
                bandwidth.sample()
                if swap is not None:
                    swap.use(kind.startswith("kernel_"))
                for part, times in component_times(model, b, repeats, args.device,
                                                   kind).items():
                    parts[kind][b].setdefault(part, []).extend(times)
                read = bandwidth.sample()
                times = step_times(model, b, steps, args.device, kind)
                steps_s[kind][b] += times
                paired.setdefault(kind, {}).setdefault(b, []).append((min(times), read))
    if swap is not None:
        swap.use(False)


def anchor_shapes(model: MiMoAudioLM) -> dict[str, tuple[int, int]]:
    """[out, in] of the products a step streams: one backbone layer, lm_head, one patch
    decoder layer (fused as the model fuses them)."""
    cfg = model.cfg
    out = {}
    for prefix, stack in (("", cfg.backbone), ("local_", cfg.patch_decoder)):
        qkv = (stack.heads + 2 * stack.kv_heads) * stack.head_dim
        out |= {f"{prefix}qkv": (qkv, stack.dim), f"{prefix}o": (stack.dim, stack.dim),
                f"{prefix}gate_up": (2 * stack.ffn_dim, stack.dim),
                f"{prefix}down": (stack.dim, stack.ffn_dim)}
        if not prefix:
            out["lm_head"] = (cfg.vocab_size, cfg.hidden)
    return out


def _zentorch():
    """zentorch's prepack and linear ops, or the reason they cannot run here."""
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except Exception as exc:  # an ImportError, or its loader refusing this torch
        return None, f"zentorch does not import: {exc}"
    ops = torch.ops.zentorch
    return (ops.zentorch_weight_prepack_for_linear,
            lambda x, w: ops.zentorch_linear_unary(x, w, None, is_weight_prepacked=True)), ""


@torch.inference_mode()
def product_anchor(model: MiMoAudioLM, args) -> dict:
    """GB/s of each step product shape through the kernel's packed products and zentorch's
    prepacked linear, 1 and 8 rows, best of --anchor-rounds alternating rounds over pools of
    >= --anchor-mib MiB (never cached)."""
    lib = cpu_kernel.library()
    zen, why = _zentorch() if args.anchor == "zentorch" else (None, "not asked for")
    report: dict = {"zentorch": why or "prepacked weights, zentorch_linear_unary"}
    gen = torch.Generator().manual_seed(1)
    for name, (rows, cols) in anchor_shapes(model).items():
        if rows % 16 or cols % 2:
            continue  # not whole blocks: never packed
        nbytes = rows * cols * 2
        pool = max(2, -(-(args.anchor_mib << 20) // nbytes))
        methods = {}
        dense = [torch.empty(rows, cols, dtype=torch.bfloat16).uniform_(-0.03, 0.03,
                                                                         generator=gen)
                 for _ in range(pool)]
        arena = cpu_kernel.huge_bytes(pool * nbytes)
        methods["kernel_packed"] = ([cpu_kernel.pack(lib, w, arena[i * nbytes:(i + 1) * nbytes])
                                     for i, w in enumerate(dense)], cpu_kernel.packed_linear)
        if zen is not None:
            methods["zentorch"] = ([zen[0](w) for w in dense], zen[1])
        del dense
        report[name] = {}
        for m in (1, 8):
            x = torch.empty(m, cols, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen)
            best = dict.fromkeys(methods, float("inf"))
            for _ in range(args.anchor_rounds):
                for method, (mats, fn) in methods.items():
                    QUIET()
                    start = time.perf_counter()
                    for w in mats:
                        fn(x, w)
                    best[method] = min(best[method], time.perf_counter() - start)
            report[name][m] = {k: round(pool * nbytes / v / 1e9, 1) for k, v in best.items()}
        del methods, arena
    return report


@torch.inference_mode()
def products_in_cache(batches: list[int], repeats: int = 5) -> dict[int, float]:
    """Bytes of packed bfloat16 weight per second that the kernel's products multiply by B
    rows when the weight stays in the last-level cache (3072 x 2048, 12 MiB: under the 32 MiB
    of the EPYC's; large enough that a call's fixed cost is a few percent): the arithmetic
    rate of the M x R tiles at each batch size, whatever the memory. Where it is below the read
    bandwidth, a batch-B step cannot beat (its weight bytes) / (this rate)."""
    lib = cpu_kernel.library()
    if lib is None:
        return {}
    gen = torch.Generator().manual_seed(2)
    weight = cpu_kernel.pack(lib, torch.empty(3072, 2048, dtype=torch.bfloat16).uniform_(
        -0.03, 0.03, generator=gen))
    calls, out = 32, {}
    for b in batches:
        x = torch.empty(b, 2048, dtype=torch.bfloat16).uniform_(-1, 1, generator=gen)

        def many(x=x):
            for _ in range(calls):
                cpu_kernel.packed_linear(x, weight)
        out[b] = calls * weight.numel() * 2 / min(timed(many, repeats, "cpu"))
    return out


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_for(level: str) -> None:
    """Build the C kernels for x86-64 `level` (not this CPU), with their own cache folder for
    the builds and the measured choices (set before either is first used)."""
    kernels.FLAGS = tuple(f"-march={level}" if flag.startswith("-march=") else flag
                          for flag in kernels.FLAGS)
    os.environ[CACHE_ENV] = str(cache_root() / f"march-{level}")


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
    parser.add_argument("--kernel", choices=("auto", "on", "off"), default="auto",
                        help="the fused CPU kernel step beside the eager one: where load_lm "
                             "would use it (auto), always (on), or never (off)")
    parser.add_argument("--quant", choices=("int8", *PACKED_QUANTS), default=None,
                        help="also time the kernel step with quantized weights: int8 "
                             "(weight-only, mimo_tts/lm/int8.py), w8a8 or w4a8 (--lm-quant)")
    parser.add_argument("--prefill", type=int, default=0, metavar="GROUPS",
                        help="also time the prefill of one prompt of GROUPS positions (the "
                             "last 8 audio groups) for each step kind (0: not)")
    parser.add_argument("--quant-only", action="store_true",
                        help="with --quant w8a8 or w4a8: pack the weights so in place and time "
                             "only that step against the bfloat16 floor (never two copies "
                             "resident: what the whole step at full size fits in)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of measurements of each step kind")
    parser.add_argument("--anchor", choices=("kernel", "zentorch"), default=None,
                        help="also time the step's product shapes alone: the kernel's (kernel) "
                             "and beside it zentorch's prepacked linear (zentorch)")
    parser.add_argument("--anchor-rounds", type=int, default=5,
                        help="alternating rounds of the product timings (best is kept)")
    parser.add_argument("--anchor-mib", type=int, default=256,
                        help="size of each pool of matrices in the product timings")
    parser.add_argument("--no-eager", dest="eager", action="store_false",
                        help="skip the eager step (row-major weights, before packing)")
    parser.add_argument("--bandwidth-mib", type=int, default=512,
                        help="size of each bandwidth probe (far above the last-level cache)")
    parser.add_argument("--march", default=None, metavar="LEVEL",
                        help="build the C kernels for this x86-64 level (x86-64-v3: AVX2, no "
                             "AVX-512) to time that path on this CPU")
    args = parser.parse_args()
    if args.march is not None:
        if not re.fullmatch(r"x86-64(-v[234])?", args.march):
            parser.error("--march takes x86-64, x86-64-v2, x86-64-v3 or x86-64-v4")
        build_for(args.march)
    if args.quant_only and args.quant not in PACKED_QUANTS:
        parser.error("--quant-only needs --quant w8a8 or w4a8")
    if args.prefill < 0 or 0 < args.prefill <= 8:
        parser.error("--prefill needs more than 8 groups (the prompt ends in 8 audio groups)")
    torch.set_num_threads(args.threads)
    QUIET.wait, QUIET.busy = args.quiet_wait, args.quiet_busy
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
