"""The native Stage-0 engine: this package's PyTorch LM behind the `lm.engine.Engine` interface,
its one call the continuous batch of `lm.batching`."""

from __future__ import annotations

from pathlib import Path

from mimo_tts.lm import cpu_kernel
from mimo_tts.lm.batching import BatchRun, ContinuousBatcher
from mimo_tts.lm.load import load_lm


class NativeEngine:
    """Stage-0 in this process on the PyTorch model; rows refill as they finish."""

    name = "native"

    def __init__(self, model, special):
        self.model, self.special, self.cfg = model, special, model.cfg

    def run_batch(self, source, rows: int, guard=None) -> BatchRun:
        """A continuous batch of `rows` pulling `lm.batching.Job`s from `source`."""
        return BatchRun(lambda: ContinuousBatcher(self.model, self.special, rows, source), guard)

    def describe(self) -> dict:
        """The sidecar's record: bfloat16 sums round differently in the CPU kernel, whose
        packed weights (where it packed them at load) say how much is on huge pages."""
        choice, prefill = cpu_kernel.choose(self.model), cpu_kernel.prefill_products(self.model)[1]
        return {"name": self.name, "cpu_kernel": choice.active,
                "cpu_kernel_reason": choice.reason, "prefill_products": prefill.reason,
                **({} if self.model.quant is None else {"lm_quant": self.model.quant}),
                **({"lm_weights": cpu_kernel.packing(self.model)}
                   if self.model.packed_bytes else {})}

    def close(self) -> None:
        """Nothing to free beyond the model itself."""


def load(lm_dir: Path, placement, options, text) -> NativeEngine:
    """`lm.engine.EngineSpec.load` for the native engine."""
    model = load_lm(lm_dir, placement.lm_device.value, placement.lm_dtype.value,
                    cpu_kernel=placement.cpu_kernel.value, quant=options.lm_quant)
    return NativeEngine(model, text.special)
