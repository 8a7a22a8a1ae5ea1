"""Load the MiMo-Audio LM checkpoint: meta build, strict safetensors load, move, eval."""

from __future__ import annotations

from pathlib import Path

import torch

from mimo_tts.errors import CheckpointError, DeviceError, UsageError
from mimo_tts.lm.config import LMConfig, quant_refusal
from mimo_tts.lm.cpu_kernel import check_mode, may_pack, prepare
from mimo_tts.lm.int8 import quantize_lm
from mimo_tts.lm.model import MiMoAudioLM
from mimo_tts.runtime.devices import torch_dtype
from mimo_tts.runtime.safetensors import load_module_weights, parse_config

# Known checkpoint tensors that inference does not use (spec §4.9).
IGNORED = (r"mel_transform\..*",)


def load_config(path: str | Path) -> LMConfig:
    """LMConfig from `<path>/config.json`."""
    return parse_config(path, LMConfig.from_json)


def load_lm(path: str | Path, device: str | torch.device = "cpu",
            dtype: torch.dtype | str = torch.float32, *,
            cpu_kernel: str = "auto", quant: str | None = None) -> MiMoAudioLM:
    """Build the LM on the meta device, load it strictly, move it to `device` in `dtype`,
    with q/k/v, gate/up and the channel heads fused as they load (no extra memory). On CPU the
    decode steps run through the fused C kernel (mimo_tts/lm/cpu_kernel.py) as `cpu_kernel`
    says: "auto", "on" or "off" (the run's `Placement.cpu_kernel`);
    `cpu_kernel.choose(model)` tells whether it does, and why (not); where it does on bfloat16
    weights, the matrices a step streams are packed for it (`cpu_kernel.prepare`).
    `quant="int8"`: int8 weight-only matrices (mimo_tts/lm/int8.py); `quant="w8a8"`: the
    streamed matrices packed as int8 for the kernel's int8-by-int8 products (bfloat16 weights;
    `cpu_kernel.pack_w8a8`); `quant="w4a8"`: packed as 4-bit groups for the kernel's
    4-bit-by-int8 products (`cpu_kernel.pack_w4a8`). All CPU only, opt-in."""
    mode = check_mode(cpu_kernel)
    try:
        dtype = torch_dtype(str(dtype).removeprefix("torch."))
    except UsageError:
        raise CheckpointError(f"unsupported LM dtype {dtype}: use float32, bfloat16 or "
                              "float16") from None
    why = quant_refusal(quant, torch.device(device).type, str(dtype).removeprefix("torch."), mode)
    if why:
        raise UsageError(f"--lm-quant {quant} {why}")
    cfg = load_config(path)
    with torch.device("meta"):
        model = MiMoAudioLM(cfg)
    model = model.to(dtype)  # the meta parameters carry the target dtype for the load below
    groups = model.fusion_groups()
    # Where the kernel may pack q/k/v and gate/up, they stay in their mapped parts and are
    # packed from there (`pack_model`): a stack of them first would be one more copy of most
    # of the weights, in fresh memory the kernel must zero.
    from_parts = model.packed_from_parts() if may_pack(device, dtype, quant, mode) else set()
    stacked = [*(g for g in groups if g not in from_parts),
               *(biases for _, biases in groups.values() if biases)]
    try:
        # q/k/v and gate/up are read straight into their fused tensors on the device; the rest
        # stays memory-mapped (zero-copy when the dtypes agree) until moved.
        stacks = load_module_weights(model, path, f"LM checkpoint {path}", ignore=IGNORED,
                                     stacked=stacked, device=device)
        model.fuse_weights(stacks)
        del stacks  # the model holds them now: packing or quantizing frees each as it goes
        # Derived buffers are still meta here: rebuild them first, then move the weights.
        model.build_buffers(torch.device(device))
        model = model.to(device=device)
        if quant == "int8":
            quantize_lm(model)
        model.quant = quant  # "w8a8", "w4a8": quantized as packed, below
    except (RuntimeError, AssertionError) as exc:  # bad index, OOM, CUDA unavailable
        raise DeviceError(f"cannot place the LM on {device}: {exc}") from None
    model.cpu_kernel = mode
    prepare(model)  # the kernel's packed layout, where it will multiply
    model.fuse_rest()  # what it did not pack, concatenated as the loader would have
    return model.eval().requires_grad_(False)
