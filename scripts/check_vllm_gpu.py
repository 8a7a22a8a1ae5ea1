"""GPU check of the vLLM engine (issue 7); prints JSON (and writes it to --out).

Meant for a CUDA machine with `pip install -e '.[vllm]'` (or the CPU venv's layout with a CUDA
vLLM). Every section runs on its own; a failing one records its error and the rest go on.

1. `equal_fp32`: tiny preset, float32 on CUDA: greedy codes and text of a mixed batch (plain
   EN / ZH, instruct, voice prompt, several lengths) from vLLM vs the native engine.
2. `seeded`: the tts samplers with a seed, twice: identical.
3. `preempt`: a KV cache too small for the batch (preemption + chunked prefill): still equal.
4. `equal_bf16`: the same batch in bfloat16: agreement rate only (kernels differ, no exactness).
5. `batch_invariance_fp32` / `_bf16` / `_bf16_greedy`: each prompt a job with its own seed (tts
   samplers; greedy), all in one `run_batch`, against each job run alone: which jobs' groups are
   equal, and the first group that differs (a job's output should not depend on its
   batch-mates; exact only where vLLM's kernels give a row the same logits in any batch).
6. `throughput`: native vs vLLM groups/s at batch 1, 8, 32 (tiny, mid, and with --wide the
   full-width backbone with --wide-layers layers), text forced to `<|empty|>`.
7. `tensor_parallel`: with 2+ GPUs, TP=2 greedy equality.

    python scripts/check_vllm_gpu.py --out /tmp/vllm_gpu.json [--wide] [--skip throughput]

`--device cpu` dry-runs the same sections in the CPU vLLM venv (to check the script itself).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm  # noqa: E402  (scripts/bench_vllm.py: shared checkpoint and prompt helpers)

from mimo_tts.lm.batching import Job, JobDone, Jobs, generate_all
from mimo_tts.lm.generate import GenerationOptions, generate
from mimo_tts.lm.load import load_config, load_lm
from mimo_tts.lm.prompts import build_prompt
from mimo_tts.lm.sampling import GREEDY, TASK_SAMPLERS
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.presets.lm import FULL_LM
from mimo_tts.presets.write import write_tiny_preset

GREEDY_OPTIONS = GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=64)
KV_BYTES = 512 << 20
NO_VLLM = 3  # exit status when vllm is not importable (scripts/gpu_check.sh says so)
DEVICE = ["cuda"]  # the native engine's device; --device cpu for a dry run


def mixed_batch(lm_dir: Path) -> list[torch.Tensor]:
    tok = TextTokenizer.from_dir(lm_dir)
    empty = load_config(lm_dir).speech_empty_ids
    gen = torch.Generator().manual_seed(0)
    voice = torch.stack([torch.randint(0, e, (33,), generator=gen) for e in empty])  # [8, 33]
    specs = [("tts_sft", "hello world", {}),
             ("tts_sft", "The quick brown fox jumps over the lazy dog near the river bank.", {}),
             ("tts_sft", "今天天气真好，我们一起去公园散步吧。", {}),
             ("tts_sft_with_instruct", "Welcome to the demo.", {"instruct": "speak slowly"}),
             ("tts_sft_with_audio", "我很高兴认识你。",
              {"instruct": "开心", "prompt_codes": voice})]
    return [build_prompt(t, x, tok, empty, template=0, **kw).input_ids for t, x, kw in specs]


def engine(lm_dir, **kw):
    from mimo_tts.lm.vllm.engine import VLLMEngine, VLLMOptions

    return VLLMEngine(lm_dir, VLLMOptions(**kw))


def compare(native_out, vllm_out) -> dict:
    same = [torch.equal(a.new_ids, b.new_ids) and a.text_tokens == b.text_tokens
            for a, b in zip(native_out, vllm_out, strict=True)]
    groups = [len(b.text_tokens) for b in vllm_out]
    return {"equal": all(same), "rows_equal": same, "groups": groups}


def check_equal(lm_dir, dtype=torch.float32, copies: int = 1, **engine_kw) -> dict:
    batch = mixed_batch(lm_dir) * copies
    native = load_lm(lm_dir, DEVICE[0], dtype)
    special = TextTokenizer.from_dir(lm_dir).special
    want = generate(native, batch, GREEDY_OPTIONS, special)
    with engine(lm_dir, dtype=str(dtype).removeprefix("torch."), **engine_kw) as eng:
        out = compare(want, generate_all(eng, batch, GREEDY_OPTIONS))
        out["joins"] = eng.last_joins
        out["preempted"] = max(eng.last_joins.values(), default=0) > 1
    return out


def check_seeded(lm_dir) -> dict:
    text, audio = TASK_SAMPLERS["tts"]
    opts = GenerationOptions(text_sampler=text, audio_sampler=audio, seed=11, max_new_groups=32)
    batch = mixed_batch(lm_dir)
    with engine(lm_dir, dtype="float32", kv_cache_memory_bytes=KV_BYTES) as eng:
        first, again = generate_all(eng, batch, opts), generate_all(eng, batch, opts)
    return {"repeat_equal": all(torch.equal(a.new_ids, b.new_ids)
                                for a, b in zip(first, again, strict=True))}


def check_batch_invariance(lm_dir, dtype: str, greedy: bool = False) -> dict:
    """Each prompt (twice over) a job with its own seed, together and each alone."""
    text, audio = (GREEDY, GREEDY) if greedy else TASK_SAMPLERS["tts"]
    batch = mixed_batch(lm_dir) * 2
    frames = load_config(lm_dir).group_size
    jobs = [Job(ids, GenerationOptions(text_sampler=text, audio_sampler=audio, seed=100 + i,
                                       max_new_groups=32), key=i) for i, ids in enumerate(batch)]

    def run(eng, some, rows):
        found = {}
        for event in eng.run_batch(Jobs(some), rows):
            if isinstance(event, JobDone):
                if event.error is not None:
                    raise event.error
                found[event.job.key] = event.generation
        return found

    with engine(lm_dir, dtype=dtype, kv_cache_memory_bytes=KV_BYTES) as eng:
        together = run(eng, jobs, len(jobs))
        alone = {}
        for job in jobs:
            alone |= run(eng, [job], 1)
    first = [first_difference(together[i], alone[i], frames) for i in range(len(jobs))]
    return {"jobs": len(jobs), "equal": first.count(None), "rows_equal": [f is None for f in first],
            "first_different_group": first}


def first_difference(a, b, frames: int) -> int | None:
    """The first group where two generations differ (text or any code), None when equal."""
    for g in range(max(len(a.text_tokens), len(b.text_tokens))):
        block = slice(g * frames, (g + 1) * frames)
        if (g >= min(len(a.text_tokens), len(b.text_tokens))
                or not torch.equal(a.new_ids[:, block], b.new_ids[:, block])):
            return g
    return None


def check_throughput(tiny: Path, tmp: Path, wide: bool, wide_layers: int) -> dict:
    configs = {"tiny": (tiny, "float32"), "mid": (bench_vllm.write_mid(tmp / "mid"),
                                                  "bfloat16")}
    if wide:
        configs["wide"] = (write_wide(tmp / "wide", wide_layers), "bfloat16")
    out = {}
    for name, (lm_dir, dtype) in configs.items():
        out[name] = {
            "dtype": dtype,
            "native": bench_vllm.bench_native(lm_dir, [1, 8, 32], 16, 2, DEVICE[0],
                                              getattr(torch, dtype)),
            "vllm": bench_vllm.bench_vllm(lm_dir, [1, 8, 32], 16, 2, dtype, KV_BYTES),
        }
    return out


def write_wide(out: Path, layers: int) -> Path:
    """The published widths (presets.FULL_LM) with `layers` backbone layers."""
    return bench_vllm.write_mid(out, dict(FULL_LM) | {"num_hidden_layers": layers})


def run(name: str, report: dict, fn, *args, **kw) -> None:
    start = time.perf_counter()
    try:
        report[name] = fn(*args, **kw)
    except Exception as exc:  # keep going: one broken section must not hide the others
        report[name] = {"error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-4000:]}
    report[name] = {**report[name], "seconds": round(time.perf_counter() - start, 1)}
    print(f"{name}: done in {report[name]['seconds']} s", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--wide-layers", type=int, default=4)
    ap.add_argument("--skip", default="", help="comma-separated section names")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    DEVICE[0] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("check_vllm_gpu: no CUDA device")
    if importlib.util.find_spec("vllm") is None:
        print("check_vllm_gpu: vllm is not installed in this interpreter", file=sys.stderr)
        sys.exit(NO_VLLM)
    skip = set(filter(None, args.skip.split(",")))
    cuda = args.device == "cuda"
    report = {"gpu": torch.cuda.get_device_name(0) if cuda else None,
              "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="vllm-gpu-") as tmp:
        tiny, _ = write_tiny_preset(Path(tmp) / "tiny", seed=0)
        sections = {
            "equal_fp32": (check_equal, (tiny,), {"kv_cache_memory_bytes": KV_BYTES}),
            "seeded": (check_seeded, (tiny,), {}),
            "preempt": (check_equal, (tiny,), {"kv_cache_memory_bytes": 7 * 32 * 512,
                                               "max_model_len": 192, "block_size": 32,
                                               "copies": 2,
                                               "max_num_batched_tokens": 16,
                                               "max_num_seqs": 8}),
            "equal_bf16": (check_equal, (tiny, torch.bfloat16),
                           {"kv_cache_memory_bytes": KV_BYTES}),
            "batch_invariance_fp32": (check_batch_invariance, (tiny, "float32"), {}),
            "batch_invariance_bf16": (check_batch_invariance, (tiny, "bfloat16"), {}),
            "batch_invariance_bf16_greedy": (check_batch_invariance, (tiny, "bfloat16", True),
                                             {}),
            "throughput": (check_throughput, (tiny, Path(tmp), args.wide, args.wide_layers), {}),
        }
        if report["gpus"] > 1:
            sections["tensor_parallel"] = (check_equal, (tiny,), {
                "tensor_parallel_size": 2, "kv_cache_memory_bytes": KV_BYTES})
        for name, (fn, fargs, fkw) in sections.items():
            if name not in skip:
                run(name, report, fn, *fargs, **fkw)
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    failed = [name for name, entry in report.items()
              if isinstance(entry, dict) and "error" in entry]
    if failed:  # a section that raised is a failed check, never a pass
        print(f"check_vllm_gpu: failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
