"""The Stage-0 engine: one interface, and the registry of the engines that implement it.

An `Engine` has one call: `run_batch(source, rows, guard)`, a continuous batch of `rows` rows
whose free rows pull `lm.batching.Job`s from `source`, each job with its own options and seed
(its codes do not depend on what it ran beside), giving `lm.batching` events: a `JobGroup` per
group as soon as its codes are known, a `JobDone` per job, `STEPPED` after each step, `IDLE`
when nothing is live and the source has nothing now, `StepFailed` when a step fails (its rows
are lost, the batch goes on). `NativeEngine` binds the PyTorch model of this package;
`lm/vllm/engine.py`'s `VLLMEngine` runs the same model on vLLM over its own request loop.
Whole runs for scripts and tests are plain helpers over any engine (`lm.batching.generate_all`,
`stream_steps`). Everything above `lm/` holds an `Engine` and asks it, or its `EngineSpec`
before loading, instead of testing the engine's name: the names appear only in `ENGINES` below.
Adding an engine is one row here plus its module with one method.

Torch-free at import: the options, the preflight and `--help` read the registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from mimo_tts.errors import UsageError
from mimo_tts.lm.vllm import DEFAULT_MAX_NUM_SEQS, VLLM_INSTALL, VLLM_SETTINGS

if TYPE_CHECKING:
    from mimo_tts.lm.batching import JobSource
    from mimo_tts.lm.config import LMConfig


class Engine(Protocol):
    """What every Stage-0 engine offers (shapes and events as in `lm.batching`)."""

    name: str
    cfg: LMConfig

    def run_batch(self, source: JobSource, rows: int,
                  guard: Callable[[], AbstractContextManager] | None = None) -> BatchEvents:
        """A continuous batch over `source`, each step under `guard()`."""

    def describe(self) -> dict:
        """The sidecar's "engine" record (and the words of the load log)."""

    def close(self) -> None:
        """Free what the engine holds (vLLM: its memory and processes)."""


class BatchEvents(Protocol):
    """What `run_batch` returns: the batch's events as they come, and cancels."""

    def __iter__(self) -> Iterator: ...  # JobGroup | JobDone | STEPPED | IDLE | StepFailed

    def cancel(self, key) -> None:
        """End the job with this key at the next step (safe from another thread)."""


@dataclass(frozen=True)
class EngineSpec:
    """An engine's facts that are needed before it is loaded (options, preflight, batching)."""

    name: str
    module: str  # the module that builds it: `module.load(lm_dir, placement, options, text)`
    settings_module: str | None = None  # torch-free `engine_settings(options, placement)`
    sizes_own_memory: bool = False  # the memory preflight leaves Stage-0 to the engine (vLLM)
    options: tuple[str, ...] = ()  # `EngineOptions` fields that apply to this engine alone
    least_rows: str | None = None  # the `EngineOptions` field with rows it keeps at least
    default_least_rows: int | None = None  # its default
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

    def rows(self, options, batch_size: int) -> int:
        """The rows of a batch run (`--batch-size`): vLLM schedules at least its own
        `max_num_seqs`."""
        if self.least_rows is None:
            return batch_size
        return max(batch_size, getattr(options, self.least_rows) or self.default_least_rows)

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
                       sizes_own_memory=True, options=VLLM_SETTINGS,
                       least_rows="max_num_seqs", default_least_rows=DEFAULT_MAX_NUM_SEQS,
                       needs="vllm", title="vLLM", install=VLLM_INSTALL),
}
DEFAULT_ENGINE = next(iter(ENGINES))


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise UsageError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
