"""Native vs vLLM Stage-0 throughput (groups/s) at several batch sizes; prints JSON.

Runs in the vLLM venv (scripts/setup_vllm_venv.sh), which has both engines:

    .vllm-venv/bin/python scripts/bench_vllm.py [--config tiny,mid] [--batch 1,8,32]
        [--groups 16] [--device cpu] [--dtype float32] [--threads N]

Configs: `tiny` is the tiny preset (backbone head_dim 32); `mid` is a mid-size random
checkpoint (hidden 1024, 8 layers, 16/4 heads of 64, ffn 2816; patch decoder 256 x 4 layers)
written by the preset writer (mimo_tts/presets/write.py) with the tiny preset's text tokenizer.
Both engines generate exactly --groups `<|empty|>` groups per prompt (text forced to
`<|empty|>`: a native logits hook, vLLM's allowed_token_ids), so each group is one backbone
step plus one 11-step patch decode. The native engine runs its static `generate` (one batch of
all prompts); vLLM runs `lm.batching.generate_all` (`run_batch` with a row per prompt).
groups/s = batch x groups / seconds, best of --repeat runs after a warm-up, excluding start-up
(reported separately). The machine may be shared: best-of, and the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from mimo_tts.lm.batching import generate_all
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.load import load_config, load_lm
from mimo_tts.lm.prompts import build_prompt
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.presets.write import write_random_checkpoint, write_tiny_preset

MID = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
       "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2816,
       "local_dim": 256, "local_layers": 4, "local_attn_heads": 16, "local_ffn_dim": 1024,
       "input_local_dim": 256, "input_local_layers": 2}
TEXTS = ("hello world", "The quick brown fox jumps over the lazy dog near the river bank.",
         "今天天气真好，我们一起去公园散步吧。", "Welcome to the MiMo audio demo.")


def write_mid(out: Path, dims=MID) -> Path:
    """A random checkpoint of `dims` in the official layout (the preset writer); its LM dir."""
    return write_random_checkpoint(out, dims)[0]


def prompts_for(lm_dir: Path, batch: int) -> list[torch.Tensor]:
    tok = TextTokenizer.from_dir(lm_dir)
    empty = load_config(lm_dir).speech_empty_ids
    return [build_prompt("tts_sft", TEXTS[i % len(TEXTS)], tok, empty, template=0).input_ids
            for i in range(batch)]


def options(groups: int, empty: int) -> GenerationOptions:
    def force(step, logits):  # the native engine: always <|empty|>
        forced = torch.full_like(logits, float("-inf"))
        forced[:, empty] = 0.0
        return forced

    return GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, min_new_groups=groups,
                             max_new_groups=groups, text_logits_processor=force)


def best_rate(run, batch: int, groups: int, repeat: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return round(batch * groups / best, 2)


def bench_native(lm_dir, batches, groups, repeat, device, dtype) -> dict:
    start = time.perf_counter()
    lm = load_lm(lm_dir, device, dtype)
    special = TextTokenizer.from_dir(lm_dir).special
    out = {"start_s": round(time.perf_counter() - start, 2)}
    opts = options(groups, special.empty)
    for b in batches:
        ps = prompts_for(lm_dir, b)
        out[f"batch_{b}"] = best_rate(lambda ps=ps: generate(lm, ps, opts, special), b, groups,
                                      repeat)
    return out


def bench_vllm(lm_dir, batches, groups, repeat, dtype: str, kv_bytes: int | None) -> dict:
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    class Forced(VLLMEngine):  # text forced to <|empty|> via vLLM's allowed_token_ids
        def _sampling_params(self, opts, prompt_len, seed, args):
            params = super()._sampling_params(opts, prompt_len, seed, args)
            params.allowed_token_ids = [self.special.empty]
            return params

    start = time.perf_counter()
    engine = Forced(lm_dir, VLLMOptions(dtype=dtype, max_num_seqs=max(batches),
                                        kv_cache_memory_bytes=kv_bytes))
    out = {"start_s": round(time.perf_counter() - start, 2)}
    plain = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, min_new_groups=groups,
                              max_new_groups=groups)
    try:
        for b in batches:
            ps = prompts_for(lm_dir, b)
            out[f"batch_{b}"] = best_rate(lambda ps=ps: generate_all(engine, ps, plain), b,
                                          groups, repeat)
    finally:
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny,mid")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:  # the same thread count for both engines (vLLM binds its OMP threads)
        torch.set_num_threads(args.threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    batches = [int(b) for b in args.batch.split(",")]
    dtype = getattr(torch, args.dtype)
    kv = args.kv_bytes if args.device == "cpu" else None
    report = {"machine": platform.machine(), "cpus": os.cpu_count(), "device": args.device,
              "dtype": args.dtype, "groups_per_prompt": args.groups, "batches": batches,
              "loadavg_start": os.getloadavg(), "configs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        tiny, _ = write_tiny_preset(Path(tmp) / "tiny", seed=0)
        dirs = {"tiny": tiny, "mid": None}
        for name in args.config.split(","):
            lm_dir = dirs.get(name) or write_mid(Path(tmp) / name)
            report["configs"][name] = {
                "native": bench_native(lm_dir, batches, args.groups, args.repeat, args.device,
                                       dtype),
                "vllm": bench_vllm(lm_dir, batches, args.groups, args.repeat, args.dtype, kv),
            }
    report["loadavg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
