"""The prefill's products at full size: PyTorch's bfloat16 GEMM against float32 blocks of the
weights (`mimo_tts.lm.model.upcast_linear`) and the CPU kernel's products on the weights it
packs at load (`cpu_kernel.pack`), back to back in one process; JSON out.

    .venv/bin/python scripts/bench_prefill.py [--rows 64,128,512] [--rounds 3] [--threads N]

One backbone layer's matrices at the published sizes (fused q/k/v, o_proj, fused gate/up,
down_proj; full-size config), random bfloat16 weights; per row count the best of `rounds`
alternating rounds of each product over the layer, GFLOP/s and the ratio. The CPU is named
with its bfloat16 flags; `cpu_kernel.upcast_faster()` (the load-time probe that picks the
product) is reported beside.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from _common import FULL_SIZE, busy_cores

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.model import upcast_linear
from mimo_tts.runtime.devices import cpu_flags


def layer_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of one backbone layer's products (fused as the model fuses them)."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    return {"qkv": (hidden + 2 * kv, hidden), "o_proj": (hidden, hidden),
            "gate_up": (2 * ffn, hidden), "down_proj": (hidden, ffn)}


def timed(product, inputs: dict, weights: dict) -> float:
    """Seconds for one layer's products: each weight by its own input rows."""
    start = time.perf_counter()
    for name, weight in weights.items():
        product(inputs[name], weight)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = json.loads((FULL_SIZE / "lm-config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in layer_shapes(config).items()}
    flops_per_row = 2 * sum(w.numel() for w in weights.values())
    lib = cpu_kernel.library()
    packed = {} if lib is None else {name: cpu_kernel.pack(lib, w) for name, w in weights.items()}
    w8a8 = {} if lib is None else {name: cpu_kernel.pack_w8a8(lib, w)
                                   for name, w in weights.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown")
    report = {"cpu": cpu, "bf16_flags": [f for f in cpu_flags() if "bf16" in f or "amx" in f],
              "threads": torch.get_num_threads(), "busy_cores_before": round(busy_cores(2), 2),
              "layer": {k: list(v) for k, v in layer_shapes(config).items()}, "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {name: torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16)
                  for name, w in weights.items()}
        products = {"torch_bf16": (F.linear, weights), "upcast": (upcast_linear, weights)}
        if packed:
            products["kernel_packed"] = (cpu_kernel.packed_linear, packed)
            products["kernel_w8a8"] = (cpu_kernel.packed_linear, w8a8)  # int8 ops, not FLOPs
        best = dict.fromkeys(products, float("inf"))
        for _ in range(args.rounds):
            for name, (product, mats) in products.items():
                best[name] = min(best[name], timed(product, inputs, mats))
        report["rows"][rows] = {
            **{f"{name}_ms": round(s * 1e3, 1) for name, s in best.items()},
            **{f"{name}_gflops": round(rows * flops_per_row / s / 1e9, 1)
               for name, s in best.items()},
            "speedup": round(best["torch_bf16"] / best["upcast"], 2),
            **({"kernel_over_torch": round(best["torch_bf16"] / best["kernel_packed"], 2),
                "w8a8_over_kernel": round(best["kernel_packed"] / best["kernel_w8a8"], 2)}
               if packed else {})}
    faster, upcast, eager = cpu_kernel.measure_upcast()
    kept = cpu_kernel.upcast_faster()
    report["load_probe"] = {"upcast_faster_now": faster, "upcast_gflops": upcast,
                            "torch_gflops": eager, "upcast_chosen": kept.faster,
                            "chosen_from": kept.source}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
