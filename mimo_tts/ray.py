"""Ray Data pipeline (`pip install 'mimo-tts[ray]'`): Stage-0 and Stage-1 on their own workers.

Three callable classes for `Dataset.map_batches`, each a thin shell around the CLI's own code:

- `Stage0`: loads the models once per actor (`BatchRunner.load`: native or vLLM engine, the
  tokenizer too, since voice prompts are encoded there) and runs `BatchRunner.codes`: prompts,
  then one generate call per seed. A GPU actor when the LM device is CUDA.
- `Stage1`: loads the audio tokenizer alone on the tokenizer device (CPU actors by default)
  and runs `batch.finish_item`: decode, join, check, resample, sidecar record.
- `Writer`: writes through the CLI's `DirectorySink` (layout, sidecars, manifest, lock, shard).

`run` is the driver: it resolves options as `mimo-tts synth` does, opens the sink, drops the
items already done (the resume keys, before Stage-0), records bad items, runs the two stages on
Ray and writes each result through `Writer` in the driver, so one process holds the output
folder. Rows carry one pickled payload each (`ItemResult`, pieces, codes, samples). Seeds and
code paths are the CLI's, so the wavs are byte-identical to `mimo-tts synth` at batch size 1.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator, Mapping

import numpy as np

from mimo_tts import checkpoints, commands
from mimo_tts.batch import BatchRunner, _guard, finish_item
from mimo_tts.errors import UsageError
from mimo_tts.results import ItemResult

PAYLOAD = "payload"


def _rows(payloads: list) -> dict:
    column = np.empty(len(payloads), dtype=object)
    column[:] = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in payloads]
    return {PAYLOAD: column}


def _payloads(batch: Mapping) -> list:
    return [pickle.loads(p) for p in batch[PAYLOAD]]


class Stage0:
    """Codes for pending `ItemResult`s: prompts and generation, as `mimo-tts synth` runs them."""

    def __init__(self, settings, argv: list[str] | None = None):
        self.runner = BatchRunner(settings)
        self.runner.load()
        self.context = {**self.runner.context(), "argv": list(argv or [])}

    def __call__(self, batch: Mapping) -> dict:
        results = _payloads(batch)
        pieces = self.runner.codes(results)
        return _rows([(r, pieces.get(id(r)), self.context) for r in results])


class Stage1:
    """Audio for Stage-0's pieces on the tokenizer device: decode, join, check, resample."""

    def __init__(self, settings):
        from mimo_tts.synth import Stage1 as Tokenizer

        self.settings = settings
        _, tok = checkpoints.resolve_names(settings.checkpoints)
        self.stage1 = Tokenizer.load(tok.path, settings.placement, lambda m: None,
                                     settings.engine.tokenizer_threads)

    def __call__(self, batch: Mapping) -> dict:
        out = []
        for result, pieces, context in _payloads(batch):
            made = None
            if result.status == "pending" and pieces is not None:
                made = _guard(result, finish_item, self.stage1, self.settings, context, result,
                              pieces)
            out.append((result, made))
        return _rows(out)


class Writer:
    """Each result through the CLI's sink: codes, sidecar, audio, then the manifest line.

    Give it the opened sink (`run` does), or settings to open one (a map_batches stage with
    one actor, where every node sees the output folder).
    """

    def __init__(self, settings, sink=None):
        self.task = settings.synthesis.task
        self.sink = sink if sink is not None else commands.sink_for(settings).open()

    def __call__(self, batch: Mapping) -> dict:
        return _rows(list(self.results(batch)))

    def results(self, batch: Mapping) -> Iterator[ItemResult]:
        for result, made in _payloads(batch):
            if made is not None:
                _guard(result, self.sink.write, result, *made)
            self.sink.finished(result, self.task)
            yield result


def run(flags: Mapping[str, object], *, config: str | None = None, stage0_actors: int = 1,
        stage1_actors: int = 1, stage0_gpus: float | None = None, stage0_cpus: float = 1,
        stage1_cpus: float = 1, batch_size: int | None = None, log=None,
        stdin=None) -> Iterator[ItemResult]:
    """`mimo-tts synth` on a Ray cluster (call `ray.init` first): `flags` are synth's options
    by name (`{"model": "tiny", "input": ["lines.txt"], "output_dir": "out"}`).

    Yields one `ItemResult` per item: skipped and bad items first, then the rest as they are
    written. `stage0_gpus` defaults to 1 per actor when the LM device is CUDA; `batch_size`
    (rows per actor call) defaults to the run's `--batch-size`.
    """
    import ray

    items, settings, runner = commands.prepare_synth(flags, config, stdin or sys.stdin,
                                                     log or (lambda m: None))
    run_options = settings.run
    if run_options.stream or run_options.output or run_options.raw:
        raise UsageError("the Ray pipeline writes an --output-dir; drop --stream, -o and --raw")
    gpus = stage0_gpus if stage0_gpus is not None else (
        1 if settings.placement.lm_device.value.startswith("cuda") else 0)
    rows = batch_size or run_options.batch_size
    runner.resolve()  # a missing checkpoint ends the run here (exit 3)
    with commands.sink_for(settings) as sink:
        pending = []
        for item in items:
            result = runner.prepare(item, sink)  # resume keys: done items never reach Stage-0
            if result.status == "pending":
                pending.append(result)
                continue
            if result.status == "error":
                sink.finished(result, settings.synthesis.task)
            yield result
        if not pending:
            return
        dataset = (
            ray.data.from_items([{PAYLOAD: p} for p in _rows(pending)[PAYLOAD]],
                                override_num_blocks=len(pending))
            .map_batches(Stage0, fn_constructor_kwargs={"settings": settings,
                                                        "argv": sys.argv[1:]},
                         batch_size=rows, num_gpus=gpus, num_cpus=stage0_cpus,
                         compute=ray.data.ActorPoolStrategy(size=stage0_actors))
            .map_batches(Stage1, fn_constructor_kwargs={"settings": settings},
                         batch_size=1, num_cpus=stage1_cpus,
                         compute=ray.data.ActorPoolStrategy(size=stage1_actors)))
        writer = Writer(settings, sink)
        for batch in dataset.iter_batches(batch_size=1, batch_format="numpy"):
            yield from writer.results(batch)
