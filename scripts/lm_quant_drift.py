"""The quantized LM's drift from the unquantized one; prints a JSON table.

Each quantization (--quant: int8 weight-only, mimo_tts/lm/int8.py; w8a8, int8 weights by int8
activations in the CPU kernel, `--lm-quant w8a8`; w4a8, 4-bit weights in groups of 32 by int8
activations, `--lm-quant w4a8`) against the same model unquantized, on two models: tiny-a (the
reference fixture checkpoint: float32 and bfloat16 for int8, bfloat16 for w8a8 and w4a8, which
need it; beside them, to read them by, tiny-a's own drift in bfloat16 from
float32) and the real width with random weights (scripts/bench_lm.py's model,
--layers backbone layers, bfloat16). On the same prompts the two are compared on:
- the text logits after the prompt: max |error|, as is and relative to max |logit|, the RMS
  error relative to the logits' RMS, and whether the greedy token agrees;
- the patch decoder's first-step logits (channel 0, the same input for both; later steps
  are fed each model's own codes) and the share of the first group's greedy codes that
  agree;
- a free greedy generation of --groups groups: the groups produced before the first one that
  differs, and the share of identical groups (random weights sit near ties: reported only);
- the audio of a second greedy generation with the text channel forced to <|empty|> (every
  group audio), decoded by the tokenizer (tiny-a's, or the full-size random one under
  .bench/full-size where it was made): the share of equal codes, the waveforms' relative RMS
  distance and its signal-to-distance ratio in dB (identical codes: identical audio).
Both models run the CPU kernel where `auto` picks it.

    .venv/bin/python scripts/lm_quant_drift.py [--quant int8,w8a8,w4a8] [--layers 2] [--groups 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import TINY_A  # noqa: E402
from bench_lm import SPECIAL, QuantSwap, _cpu_name, audio_prompt, build_model  # noqa: E402

from mimo_tts.codec.load import load_audio_tokenizer
from mimo_tts.lm.extract import extract_codes
from mimo_tts.lm.generate import GenerationOptions, decode_patch, decode_step, generate, prefill
from mimo_tts.lm.load import load_lm
from mimo_tts.lm.sampling import GREEDY
from mimo_tts.lm.text import TextTokenizer

BIG = Path(__file__).resolve().parents[1] / ".bench" / "full-size"  # scripts/make_full_size.py


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
        spoken = replace(options(groups), text_logits_processor=partial(_speak, special))
        out.append({"text": step.text_logits(state.hidden)[0],
                    "first_step": record[0][0][0], "codes": codes[0],
                    "ids": generate(model, [prompt], options(groups), special)[0].new_ids,
                    "audio_ids": generate(model, [prompt], spoken, special)[0].new_ids})
    return out


def _speak(special, step, logits):
    """Every group an audio group (the text channel forced to <|empty|>): the audio run."""
    logits = logits.clone()
    logits[:, special.empty] = 1e4
    return logits


@torch.inference_mode()
def audio_of(ids: torch.Tensor, tokenizer, empty: list[int], frames: int) -> torch.Tensor | None:
    """Every generated group's codes (frames whose channel-0 code is not empty) decoded."""
    try:
        codes = extract_codes(ids, 0, ids.shape[1] // frames, empty, frames)
    except Exception:  # codes outside the tokenizer's range: no audio to compare
        return None
    return None if codes is None else tokenizer.decode(codes).float()


def audio_distance(a: torch.Tensor | None, b: torch.Tensor | None) -> dict:
    if a is None or b is None:
        return {"audio": "none (no audio codes)"}
    n = min(a.numel(), b.numel())
    diff = (a[:n] - b[:n]).norm().item()
    rel = diff / max(a[:n].norm().item(), 1e-12)
    return {"audio_seconds": [round(a.numel() / 24000, 2), round(b.numel() / 24000, 2)],
            "audio_relative_rms_distance": round(rel, 4),
            "audio_snr_db": None if diff == 0 else round(-20 * math.log10(max(rel, 1e-12)), 1)}


def table(ref: list[dict], quant: list[dict], frames: int, tokenizer=None,
          empty: list[int] | None = None) -> dict:
    rows = []
    for a, b in zip(ref, quant, strict=True):
        text_err = (b["text"].float() - a["text"].float()).abs().max().item()
        chan_err = (b["first_step"].float() - a["first_step"].float()).abs().max().item()
        chan_scale = a["first_step"].float().abs().max().item()
        same = [bool(torch.equal(x, y)) for x, y in zip(
            a["ids"].split(frames, 1), b["ids"].split(frames, 1), strict=False)]
        row = {
            "text_logit_max_error": round(text_err, 4),
            "text_logit_relative_error": round(text_err / a["text"].float().abs().max().item(),
                                               4),
            "text_logit_relative_rms_error": round(
                ((b["text"].float() - a["text"].float()).pow(2).mean()
                 / a["text"].float().pow(2).mean()).sqrt().item(), 4),
            "text_greedy_agrees": int(a["text"].argmax()) == int(b["text"].argmax()),
            "first_step_logit_max_error": round(chan_err, 4),
            "first_step_logit_relative_error": round(chan_err / chan_scale, 4),
            "codes_greedy_agreement": round((a["codes"] == b["codes"]).float().mean().item(), 3),
            "groups_before_first_difference": same.index(False) if False in same else len(same),
            "identical_groups": f"{sum(same)} of {len(same)}",
        }
        if tokenizer is not None:
            same_audio = torch.equal(a["audio_ids"], b["audio_ids"])
            row.update(audio_distance(audio_of(a["audio_ids"], tokenizer, empty, frames),
                                      audio_of(b["audio_ids"], tokenizer, empty, frames)),
                       audio_codes_identical=same_audio,
                       audio_codes_agreement=round((a["audio_ids"][1:] == b["audio_ids"][1:])
                                                   .float().mean().item(), 3))
        rows.append(row)
    snr = [r["audio_snr_db"] for r in rows if r.get("audio_snr_db") is not None]
    return {
        "prompts": len(rows),
        "worst_text_logit_relative_error": max(r["text_logit_relative_error"] for r in rows),
        "worst_text_logit_relative_rms_error": max(r["text_logit_relative_rms_error"]
                                                   for r in rows),
        "worst_first_step_logit_relative_error": max(r["first_step_logit_relative_error"]
                                                  for r in rows),
        "text_greedy_agreement": round(sum(r["text_greedy_agrees"] for r in rows) / len(rows), 3),
        "codes_greedy_agreement": round(sum(r["codes_greedy_agreement"] for r in rows)
                                        / len(rows), 3),
        **({"worst_audio_snr_db": min(snr)} if snr else {}),
        "rows": rows,
    }


def tiny_a(dtype: str, groups: int, quant: str | None, ref_dtype: str | None = None) -> dict:
    """tiny-a in `dtype` quantized by `quant` against it unquantized; quant None: `dtype`
    against `ref_dtype` (the drift of bfloat16 itself, to read the others by)."""
    from safetensors.torch import load_file

    lm_dir = TINY_A / "lm"
    special = TextTokenizer.from_dir(lm_dir).special
    cases = json.loads((TINY_A / "cases" / "cases.json").read_text())
    prompts = []
    for group in ("lm_generate", "voice_prompt"):
        tensors = load_file(TINY_A / "cases" / f"{group}.safetensors")
        prompts += [tensors[f"{c['name']}.input_ids"] for c in cases["groups"][group]["cases"]
                    if f"{c['name']}.input_ids" in tensors]
    ref_model = load_lm(lm_dir, dtype=ref_dtype or dtype)
    ref = measure(ref_model, prompts, special, groups)
    measured = measure(load_lm(lm_dir, dtype=dtype, quant=quant), prompts, special, groups)
    tokenizer = load_audio_tokenizer(TINY_A / "tokenizer")
    return table(ref, measured, ref_model.cfg.group_size, tokenizer,
                 list(ref_model.cfg.speech_empty_ids))


def full_width(layers: int, groups: int, quants: list[str], audio: bool) -> dict:
    """The random-weight model measured, then each quantized copy (swapped in, one model)."""
    model = build_model(layers, "cpu", torch.bfloat16)
    prompts = [audio_prompt(model, 48, seed) for seed in range(3)]
    ref = measure(model, prompts, SPECIAL, groups)
    tokenizer = None
    if audio and (BIG / "complete").exists():
        tokenizer = load_audio_tokenizer(BIG / "tokenizer")
    out = {}
    for quant in quants:
        swap = QuantSwap(model, quant)
        swap.use(True)
        out[quant] = table(ref, measure(model, prompts, SPECIAL, groups), model.cfg.group_size,
                           tokenizer, list(model.cfg.speech_empty_ids))
        swap.use(False)
        del swap
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="int8,w8a8,w4a8",
                        help="quantizations, comma-separated")
    parser.add_argument("--layers", type=int, default=2, help="full-width backbone layers")
    parser.add_argument("--groups", type=int, default=8, help="groups of free generation")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-full-width", action="store_true")
    parser.add_argument("--no-full-width-audio", action="store_true",
                        help="skip decoding the full-width runs (the 1.3 B tokenizer)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quants = args.quant.split(",")
    report: dict = {"cpu": _cpu_name(), "threads": torch.get_num_threads(),
                    "tiny_a_bfloat16_unquantized_vs_float32": tiny_a("bfloat16", args.groups,
                                                                      None, "float32")}
    for quant in quants:
        for dtype in ("float32", "bfloat16") if quant == "int8" else ("bfloat16",):
            report[f"tiny_a_{dtype}_{quant}"] = tiny_a(dtype, args.groups, quant)
    if not args.skip_full_width:
        report[f"full_width_{args.layers}_layers_bfloat16"] = full_width(
            args.layers, args.groups, quants, not args.no_full_width_audio)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
