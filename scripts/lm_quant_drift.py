"""The int8 weight-only LM's drift from the unquantized one; prints a JSON table.

Two models: tiny-a (the reference fixture checkpoint, float32 and bfloat16) and the real
width with random weights (scripts/bench_lm.py's model, --layers backbone layers, bfloat16).
For each, on the same prompts, the unquantized model and its int8 copy (mimo_tts/lm/int8.py)
are compared on:
- the text logits after the prompt: max |error|, as is and relative to max |logit|, and
  whether the greedy token agrees;
- the patch decoder's first-step logits (channel 0, the same input for both; later steps
  are fed each model's own codes) and the share of the first group's greedy codes that
  agree;
- a free greedy generation of --groups groups: the groups produced before the first one that
  differs, and the share of identical groups (random weights sit near ties: reported only).
Both models run the CPU kernel where `auto` picks it.

    .venv/bin/python scripts/lm_quant_drift.py [--layers 2] [--groups 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY_A  # noqa: E402
from bench_lm import SPECIAL, _cpu_name, audio_prompt, build_model  # noqa: E402

from mimo_tts.lm.generate import GenerationOptions, decode_patch, decode_step, generate, prefill
from mimo_tts.lm.int8 import quantize_lm
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.text import TextTokenizer


def options(groups: int) -> GenerationOptions:
    return GenerationOptions(text_sampler=GREEDY, audio_sampler=GREEDY, max_new_groups=groups)


@torch.inference_mode()
def measure(model, prompts, special, groups: int) -> list[dict]:
    """Per prompt: text logits [V] after it, channel logits per channel and greedy codes of
    the first group, and a free greedy generation's new ids."""
    out = []
    for prompt in prompts:
        state = prefill(model, [prompt], options(groups), special)
        step = decode_step(model, state, options(groups))
        record = [[] for _ in range(model.cfg.audio_channels)]
        local_in = model.hidden_states_downcast(state.hidden)
        codes = decode_patch(model, local_in, GREEDY, None, step, record)
        out.append({"text": step.text_logits(state.hidden)[0],
                    "first_step": record[0][0][0], "codes": codes[0],
                    "ids": generate(model, [prompt], options(groups), special)[0].new_ids})
    return out


def table(ref: list[dict], quant: list[dict], frames: int) -> dict:
    rows = []
    for a, b in zip(ref, quant, strict=True):
        text_err = (b["text"] - a["text"]).abs().max().item()
        chan_err = (b["first_step"] - a["first_step"]).abs().max().item()
        chan_scale = a["first_step"].abs().max().item()
        same = [bool(torch.equal(x, y)) for x, y in zip(
            a["ids"].split(frames, 1), b["ids"].split(frames, 1), strict=False)]
        rows.append({
            "text_logit_max_error": round(text_err, 4),
            "text_logit_relative_error": round(text_err / a["text"].abs().max().item(), 4),
            "text_greedy_agrees": int(a["text"].argmax()) == int(b["text"].argmax()),
            "first_step_logit_max_error": round(chan_err, 4),
            "first_step_logit_relative_error": round(chan_err / chan_scale, 4),
            "codes_greedy_agreement": round((a["codes"] == b["codes"]).float().mean().item(), 3),
            "groups_before_first_difference": same.index(False) if False in same else len(same),
            "identical_groups": f"{sum(same)} of {len(same)}",
        })
    return {
        "prompts": len(rows),
        "worst_text_logit_relative_error": max(r["text_logit_relative_error"] for r in rows),
        "worst_first_step_logit_relative_error": max(r["first_step_logit_relative_error"]
                                                  for r in rows),
        "text_greedy_agreement": round(sum(r["text_greedy_agrees"] for r in rows) / len(rows), 3),
        "codes_greedy_agreement": round(sum(r["codes_greedy_agreement"] for r in rows)
                                        / len(rows), 3),
        "rows": rows,
    }


def tiny_a(dtype: str, groups: int) -> dict:
    from safetensors.torch import load_file

    lm_dir = TINY_A / "lm"
    special = TextTokenizer.from_dir(lm_dir).special
    cases = json.loads((TINY_A / "cases" / "cases.json").read_text())
    prompts = []
    for group in ("lm_generate", "voice_prompt"):
        tensors = load_file(TINY_A / "cases" / f"{group}.safetensors")
        prompts += [tensors[f"{c['name']}.input_ids"] for c in cases["groups"][group]["cases"]
                    if f"{c['name']}.input_ids" in tensors]
    ref = measure(load_lm(lm_dir, dtype=dtype), prompts, special, groups)
    quant = measure(load_lm(lm_dir, dtype=dtype, quant="int8"), prompts, special, groups)
    return table(ref, quant, 4)


def full_width(layers: int, groups: int) -> dict:
    """The random-weight model, measured, quantized in place, measured again (one model in
    memory)."""
    model = build_model(layers, "cpu", torch.bfloat16)
    prompts = [audio_prompt(model, 48, seed) for seed in range(3)]
    ref = measure(model, prompts, SPECIAL, groups)
    quantize_lm(model, "int8")
    return table(ref, measure(model, prompts, SPECIAL, groups), model.cfg.group_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="full-width backbone layers")
    parser.add_argument("--groups", type=int, default=8, help="groups of free generation")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-full-width", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {"cpu": _cpu_name(), "threads": torch.get_num_threads(),
              "tiny_a_float32": tiny_a("float32", args.groups),
              "tiny_a_bfloat16": tiny_a("bfloat16", args.groups)}
    if not args.skip_full_width:
        report[f"full_width_{args.layers}_layers_bfloat16"] = full_width(args.layers,
                                                                         args.groups)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
