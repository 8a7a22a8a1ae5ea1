"""The Stage-0 engine: one interface, and the registry of the engines that implement it.

An `Engine` turns prompt ids into generated groups: `generate` (whole generations), `stream`
(`StepOutput`s as they come) and, where `continuous`, `run_batch` (a continuous batch whose free
rows pull jobs, lm.batching). `NativeEngine` binds the PyTorch model of this package;
`lm/vllm/engine.py`'s `VLLMEngine` runs the same model on vLLM. Everything above `lm/` holds an
`Engine` and asks it, or its `EngineSpec` before loading, instead of testing the engine's name:
the names appear only in `ENGINES` below. Adding an engine is one row here plus its module.

Torch-free at import: the options, the preflight and `--help` read the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mimo_tts.errors import UsageError
from mimo_tts.lm.vllm import DEFAULT_MAX_NUM_SEQS, VLLM_INSTALL, VLLM_SETTINGS


class Engine(Protocol):
    """What every Stage-0 engine offers (shapes as in `lm.generate`)."""

    name: str
    cfg: object  # LMConfig
    continuous: bool  # rows refill as they finish (`run_batch`); otherwise static batches

    def generate(self, prompts: Sequence, options) -> list: ...  # -> list[Generation]
    def stream(self, prompts: Sequence, options) -> Iterator: ...  # -> StepOutputs
    def run_batch(self, source, rows: int,
                  guard: Callable[[], AbstractContextManager] | None = None) -> Iterable: ...
    # -> lm.batching.BatchRun (continuous engines only)
    def describe(self) -> dict: ...  # the sidecar's "engine" record
    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """An engine's facts that are needed before it is loaded (options, preflight, batching)."""

    name: str
    module: str  # the module that builds it: `module.load(lm_dir, placement, options, text)`
    settings_module: str | None = None  # torch-free `engine_settings(options, placement)`
    continuous: bool = True  # `run_batch` available: batch jobs and the server keep rows full
    sizes_own_memory: bool = False  # the memory preflight leaves Stage-0 to the engine (vLLM)
    options: tuple[str, ...] = ()  # `EngineOptions` fields that apply to this engine alone
    default_rows: int | None = None  # rows one static call takes at least (vLLM max_num_seqs)
    needs: str | None = None  # the import it needs, when optional
    title: str | None = None  # that package's name in messages
    install: str | None = None  # how to get it

    def check_installed(self) -> None:
        """Fail before loading anything when the engine's package is missing (exit 2)."""
        if self.needs is None:
            return
        try:
            importlib.import_module(self.module)  # sets the engine's env defaults first
            importlib.import_module(self.needs)
        except ImportError as exc:
            if getattr(exc, "name", None) == self.needs:
                raise UsageError(f"--engine {self.name} needs {self.title}, which is not "
                                 f"installed: {self.install}") from None
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UsageError(f"--engine {self.name}: {self.title} fails to import ({first}); "
                             f"reinstall it: {self.install}") from None

    def rows_per_call(self, options, batch_size: int, stream: bool) -> int:
        """Prompts per Stage-0 call of a static batch (streams run one at a time each)."""
        if stream or self.default_rows is None:
            return batch_size
        return max(batch_size, getattr(options, "max_num_seqs", None) or self.default_rows)

    def settings(self, options, placement) -> dict:
        """The engine's own settings for preflights and sidecars; nothing is imported."""
        if self.settings_module is None:
            return {}
        return importlib.import_module(self.settings_module).engine_settings(options, placement)

    def load(self, lm_dir: Path, placement, options, text) -> Engine:
        """The loaded engine (`text`: the LM's TextTokenizer)."""
        self.check_installed()
        return importlib.import_module(self.module).load(lm_dir, placement, options, text)


ENGINES = {
    "native": EngineSpec("native", "mimo_tts.lm.native", options=("lm_quant",)),
    "vllm": EngineSpec("vllm", "mimo_tts.lm.vllm.engine", "mimo_tts.lm.vllm.launch",
                       continuous=False, sizes_own_memory=True, options=VLLM_SETTINGS,
                       default_rows=DEFAULT_MAX_NUM_SEQS, needs="vllm", title="vLLM",
                       install=VLLM_INSTALL),
}
DEFAULT_ENGINE = next(iter(ENGINES))


def option_owner(option: str) -> EngineSpec | None:
    """The engine an engine-only option belongs to (None: every engine takes it)."""
    return next((spec for spec in ENGINES.values() if option in spec.options), None)


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
