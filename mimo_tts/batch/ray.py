"""Ray Data pipeline (`pip install 'mimo-tts[ray]'`): Stage-0 and Stage-1 on their own workers.

Three callable classes for `Dataset.map_batches`, each a thin shell around the CLI's own code:

- `GenerateCodes`: loads the models once per actor (`BatchRunner.load`: native or vLLM engine, the
  tokenizer too, since voice prompts are encoded there) and runs `BatchRunner.codes`: prompts,
  then one generate call per seed. A GPU actor when the LM device is CUDA.
- `DecodeAudio`: loads the audio tokenizer alone on the tokenizer device (CPU actors by default)
  and runs `batch.finish_item`: decode, join, check, resample, sidecar record.
- `WriteResults`: writes through the CLI's `DirectorySink` (layout, sidecars, manifest, lock,
  shard).

`run` is the driver: `planned` plans a `SynthRequest` as `mimo-tts synth` does (`plan_synth`:
settings, shard, items), opens the sink, drops the items already done (the resume keys, before
Stage-0) and records bad items; `pipeline` runs the two stages on Ray; each result is written
through `WriteResults` in the driver, so one process holds the output folder. Rows carry one pickled
payload each (`ItemResult`, pieces, codes, samples). Seeds and code paths are the CLI's, so the
wavs are byte-identical to `mimo-tts synth`'s at batch size 1.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Iterator, Mapping

import numpy as np

from mimo_tts.batch.items import printable
from mimo_tts.batch.plan import SynthRequest, plan_synth, sink_for
from mimo_tts.batch.results import ItemResult, guarded
from mimo_tts.batch.runner import BatchRunner, finish_item
from mimo_tts.errors import UsageError

PAYLOAD = "payload"


def _rows(payloads: list) -> dict:
    column = np.empty(len(payloads), dtype=object)
    column[:] = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in payloads]
    return {PAYLOAD: column}


def _payloads(batch: Mapping) -> list:
    return [pickle.loads(p) for p in batch[PAYLOAD]]


class GenerateCodes:
    """Codes for pending `ItemResult`s: prompts and generation, as `mimo-tts synth` runs them."""

    def __init__(self, settings, argv: list[str] | None = None):
        self.runner = BatchRunner(settings)
        self.runner.ensure_loaded()
        self.context = {**self.runner.context(), "argv": list(argv or [])}

    def __call__(self, batch: Mapping) -> dict:
        results = _payloads(batch)
        pieces = self.runner.codes(results)
        return _rows([(r, pieces.get(id(r)), self.context) for r in results])


class DecodeAudio:
    """Audio for Stage-0's pieces on the tokenizer device: decode, join, check, resample."""

    def __init__(self, settings):
        from mimo_tts.synthesis.preflight import lengths_for
        from mimo_tts.synthesis.stage1 import Stage1

        self.settings = settings
        self.stage1 = Stage1.from_settings(  # decodes: the encoder is not read
            settings, lengths=lengths_for(settings, [], encodes=False))

    def __call__(self, batch: Mapping) -> dict:
        out = []
        for result, pieces, context in _payloads(batch):
            made = None
            if result.status == "pending" and pieces is not None:
                made = guarded(result, finish_item, self.stage1, self.settings, context, result,
                              pieces)
            out.append((result, made))
        return _rows(out)


class WriteResults:
    """Each result through the CLI's sink: codes, sidecar, audio, then the manifest line.

    Give it the opened sink (`run` does), or the plan's settings and shard (and the tasks its
    JSONL lines name) to open one (a map_batches stage with one actor, where every node sees
    the output folder).
    """

    def __init__(self, settings, sink=None, shard=None, tasks=()):
        self.task = settings.synthesis.task
        self.sink = sink if sink is not None else sink_for(settings, shard, tasks).open()

    def __call__(self, batch: Mapping) -> dict:
        return _rows(list(self.results(batch)))

    def results(self, batch: Mapping) -> Iterator[ItemResult]:
        for result, made in _payloads(batch):
            if made is not None:
                guarded(result, self.sink.write, result, *made)
            self.sink.finished(result, result.item.task or self.task)
            yield result


def pipeline(settings, pending: list[ItemResult], *, stage0_actors: int = 1,
             stage1_actors: int = 1, stage0_gpus: float | None = None, stage0_cpus: float = 1,
             stage1_cpus: float = 1, batch_size: int | None = None):
    """The Ray Dataset of pending results through `GenerateCodes` then `DecodeAudio` actors; its
    rows are ready for `WriteResults` (in the driver, or mapped as a third stage with one actor).

    `stage0_gpus` defaults to 1 per actor when the LM device is CUDA; `batch_size` (rows per
    Stage-0 call) to the run's `--batch-size`.
    """
    import ray

    argv = [printable(a) for a in sys.argv[1:]]
    gpus = stage0_gpus if stage0_gpus is not None else (
        1 if settings.placement.lm_device.value.startswith("cuda") else 0)
    return (
        ray.data.from_items([{PAYLOAD: p} for p in _rows(pending)[PAYLOAD]],
                            override_num_blocks=max(len(pending), 1))
        .map_batches(GenerateCodes, fn_constructor_kwargs={"settings": settings, "argv": argv},
                     batch_size=batch_size or settings.run.batch_size, num_gpus=gpus,
                     num_cpus=stage0_cpus, compute=ray.data.ActorPoolStrategy(size=stage0_actors))
        .map_batches(DecodeAudio, fn_constructor_kwargs={"settings": settings}, batch_size=1,
                     num_cpus=stage1_cpus, compute=ray.data.ActorPoolStrategy(size=stage1_actors)))


@contextlib.contextmanager
def planned(request: SynthRequest, *, log=None, stdin=None):
    """`mimo-tts synth`'s plan (settings, shard, the shard's items), each item checked against
    the output folder: yields (the plan, the opened sink, pending results for Stage-0, the
    others), the folder's lock held until the block ends. Done items are skipped (the resume
    keys), bad ones recorded in the manifest.
    """
    log = log or (lambda m: None)
    plan = plan_synth(request, stdin or sys.stdin, log)
    settings = plan.settings
    run = settings.run
    if run.stream or run.output or run.raw:
        raise UsageError("the Ray pipeline writes an --output-dir; drop --stream, -o and --raw")
    runner = BatchRunner(settings, log=log)
    runner.resolve()  # a missing checkpoint ends the run here (exit 3)
    with plan.sink() as sink:
        pending, others = [], []
        for item in plan.items:
            result = runner.prepare(item, sink)
            if result.status == "error":
                sink.finished(result, settings.synthesis.task)
            (pending if result.status == "pending" else others).append(result)
        yield plan, sink, pending, others


def run(request: SynthRequest, *, log=None, stdin=None, **actors) -> Iterator[ItemResult]:
    """`mimo-tts synth` on a Ray cluster (call `ray.init` first): `request` is what synth's
    flags make (`SynthRequest(OptionValues(model="tiny", output_dir="out"),
    inputs=("lines.txt",))`), `actors` the sizes of `pipeline`. The driver holds the output
    folder from the resume check to the last write. Yields one `ItemResult` per item: skipped
    and bad items first, then the rest as they are written.
    """
    with planned(request, log=log, stdin=stdin) as (plan, sink, pending, others):
        yield from others
        if not pending:
            return
        writer = WriteResults(plan.settings, sink)
        batches = pipeline(plan.settings, pending, **actors).iter_batches(batch_size=1,
                                                                          batch_format="numpy")
        for batch in batches:
            yield from writer.results(batch)
