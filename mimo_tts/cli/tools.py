"""The other commands: `status` (an output folder's progress), `download` (the checkpoints),
`selftest` (a seconds-long run on the tiny preset) and `serve` (the OpenAI-compatible API)."""

from __future__ import annotations

from typing import Annotated

import typer

from mimo_tts.cli.params import (
    GEN,
    SERVE,
    Config,
    Debug,
    Dtype,
    Graph,
    LmDevice,
    LmThreads,
    Model,
    NoMemoryCheck,
    SelftestJson,
    StatusJson,
    TokDevice,
    TokDtype,
    Tokenizer,
    TokThreads,
    Verbose,
)
from mimo_tts.cli.report import Reporter, run_command
from mimo_tts.errors import EXIT_OK, AudioCheckError
from mimo_tts.presets import TINY
from mimo_tts.runtime import checkpoints
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL, DEFAULT_TOKENIZER
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE
from mimo_tts.synthesis.settings import OptionValues, resolve


def status(
    output_dir: Annotated[str, typer.Argument(
        metavar="OUTPUT_DIR",
        help="The output folder (--output-dir of synth), or its <task> folder.")],
    input: Annotated[list[str] | None, typer.Option(
        "--input", "-i", metavar="FILE", help="The run's input file(s): items without a result "
                                              "count as missing.")] = None,
    task: Annotated[str, typer.Option(
        metavar="TASK", help="synth's --task: the task folder under OUTPUT_DIR (for the folder "
                             "of a task that JSONL lines name, give that folder as "
                             "OUTPUT_DIR).")] = "tts_sft",
    seed: Annotated[int, typer.Option(
        metavar="SEED", help="synth's --seed: with --input it names and keys the items "
                             "(default 0).")] = 0,
    instruct: Annotated[str | None, typer.Option(
        metavar="TEXT", help="synth's --instruct, likewise.")] = None,
    prompt_audio: Annotated[str | None, typer.Option(
        metavar="FILE", help="synth's --prompt-audio, likewise.")] = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="Write every shard's lines into one results.jsonl.")] = False,
    as_json: StatusJson = False, debug: Debug = False,
) -> None:
    """Done / failed / missing items across all shards' manifests of an output folder.

    Give it synth's --input and the --seed, --instruct and --prompt-audio the run had: they
    name the items. A book's folder (mimo-tts book) names its own pieces, with a line per
    chapter. Exits 0 when every item is done, 10 when some are failed or missing.
    """
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts.batch import status as folder_status
        from mimo_tts.batch.items import Naming
        from mimo_tts.book import status as book_status

        if not input and book_status.is_book(output_dir):
            report, lines = book_status.report(output_dir, merge), book_status.lines
        else:
            report = folder_status.report(output_dir, task, input or [], merge,
                                          Naming(seed, instruct, prompt_audio, task))
            lines = folder_status.lines
        if as_json:
            reporter.data(report)
        else:
            for line in lines(report):
                reporter.data(line)
        return folder_status.exit_code(report)

    run_command(reporter, body)


def download(
    model: Annotated[str, typer.Option(metavar="REPO", help="LM repo id.")] = DEFAULT_MODEL,
    tokenizer: Annotated[str, typer.Option(metavar="REPO", help="Tokenizer repo id.")] =
        DEFAULT_TOKENIZER,
    debug: Debug = False,
) -> None:
    """Fetch the checkpoints into the Hugging Face cache (needs network access)."""
    reporter = Reporter(debug=debug)

    def body() -> int:
        for ref in checkpoints.download([model, tokenizer]):
            reporter.data(f"{ref.name}\t{ref.path}")
        return EXIT_OK

    run_command(reporter, body)


def selftest(
    lm_device: LmDevice = None, tokenizer_device: TokDevice = None,
    as_json: SelftestJson = False, debug: Debug = False,
) -> None:
    """A seconds-long end-to-end run on the tiny preset; checks length, finiteness, loudness."""
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        report = run_selftest(lm_device, tokenizer_device, reporter.log)
        reporter.data(report) if as_json else reporter.info(
            f"selftest ok: {report['seconds']:.2f} s of audio, peak {report['peak']:.3f}, "
            f"RTF {report['rtf']:.3f} ({report['path']})")
        return EXIT_OK

    run_command(reporter, body)


def run_selftest(lm_device: str | None, tokenizer_device: str | None, log) -> dict:
    """End-to-end on the tiny preset in a temp dir; checks rate, length, finiteness, level."""
    import tempfile

    import soundfile as sf

    from mimo_tts.batch.files import load_codes
    from mimo_tts.batch.items import Item
    from mimo_tts.batch.plan import run_synth, sink_for
    from mimo_tts.batch.runner import BatchRunner

    with tempfile.TemporaryDirectory(prefix="mimo-tts-selftest-") as tmp:
        settings = resolve(OptionValues(model=TINY, lm_device=lm_device or "cpu",
                                        tokenizer_device=tokenizer_device or "cpu",
                                        output_dir=tmp, save_codes=True))
        runner = BatchRunner(settings, log=log)
        item = Item(id="selftest", text="Hello from MiMo.", source="selftest")
        (result,) = list(run_synth(runner, [item], sink_for(settings)))
        if result.status != "ok":
            error = AudioCheckError(f"selftest failed: {result.error}")
            error.exit_code = result.exit_code
            raise error
        audio, rate = sf.read(str(result.path), dtype="float32")
        pieces, _ = load_codes(result.codes_path)
        frames = sum(p.shape[1] for p in pieces) + PAUSE_FRAMES * (len(pieces) - 1)
        problems = _selftest_problems(audio, rate, frames, runner.tts.stage1.samples_per_frame)
        if problems:
            raise AudioCheckError("selftest failed: " + "; ".join(problems))
        peak = float(abs(audio).max())
        return {"status": "ok", "seconds": len(audio) / rate, "frames": frames, "peak": peak,
                "rtf": result.rtf, "load_s": runner.timings.get("load_s"),
                "path": "(temporary) " + result.path.name}


def _selftest_problems(audio, rate: int, frames: int, per_frame: int) -> list[str]:
    import numpy as np

    problems = []
    if rate != SAMPLE_RATE:
        problems.append(f"sample rate {rate} != {SAMPLE_RATE}")
    if len(audio) != frames * per_frame:
        problems.append(f"{len(audio)} samples != {per_frame} x {frames} frames")
    if not np.isfinite(audio).all():
        problems.append("non-finite samples")
    if float(np.abs(audio).max(initial=0.0)) < 1e-3:
        problems.append("silent output")
    if not 0.5 <= len(audio) / SAMPLE_RATE <= 60:
        problems.append(f"implausible length {len(audio) / SAMPLE_RATE:.2f} s")
    return problems


def serve(
    host: Annotated[str | None, typer.Option(rich_help_panel=SERVE, metavar="HOST",
        help="Address to bind (default 127.0.0.1: this machine only).")] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="PORT",
                                             help="Port (default 8000).")] = None,
    api_key: Annotated[str | None, typer.Option(rich_help_panel=SERVE, metavar="KEY",
                                                show_default=False,
        help="Require 'Authorization: Bearer KEY' on /v1 and /metrics (env "
             "MIMO_TTS_API_KEY).")] = None,
    voice: Annotated[list[str] | None, typer.Option(rich_help_panel=SERVE, metavar="VOICE",
        help="Register a voice-clone voice: NAME=PROMPT.wav (repeatable).")] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Requests generated together in one Stage-0 batch (default 8).")] = None,
    max_concurrent: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Requests in progress at once (default 16).")] = None,
    max_queue: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Requests waiting beyond those; more get 503 + Retry-After (default 32).")] = None,
    max_input_chars: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Longest input text (default 4096).")] = None,
    timeout: Annotated[float | None, typer.Option(rich_help_panel=SERVE, metavar="SECONDS",
        help="Seconds a request may take (default 300).")] = None,
    stage1_batch: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="N",
        help="Streamed requests whose audio is decoded together (default 16; 1: one at a "
             "time).")] = None,
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
        help="Cap on generated groups per text piece (one group = 160 ms).")] = None,
    model: Model = None, tokenizer: Tokenizer = None, lm_device: LmDevice = None,
    tokenizer_device: TokDevice = None, dtype: Dtype = None, tokenizer_dtype: TokDtype = None,
    cuda_graph: Graph = None, no_memory_check: NoMemoryCheck = None,
    lm_threads: LmThreads = None, tokenizer_threads: TokThreads = None, config: Config = None,
    verbose: Verbose = False, debug: Debug = False,
) -> None:
    """Serve an OpenAI-compatible speech API: POST /v1/audio/speech (needs the serve extra)."""
    serving = {"host": host, "port": port, "api_key": api_key, "voice": voice,
               "batch_size": batch_size, "max_concurrent": max_concurrent, "max_queue": max_queue,
               "max_input_chars": max_input_chars, "timeout": timeout,
               "stage1_batch": stage1_batch}
    options = OptionValues(
        max_new_groups=max_new_groups, model=model, tokenizer=tokenizer, lm_device=lm_device,
        tokenizer_device=tokenizer_device, dtype=dtype, tokenizer_dtype=tokenizer_dtype,
        cuda_graph=cuda_graph, no_memory_check=no_memory_check, lm_threads=lm_threads,
        tokenizer_threads=tokenizer_threads)
    run_server("mimo_tts.server.app", serving, options, config, verbose, debug)


def run_server(module: str, serving: dict, options: OptionValues, config: str | None,
               verbose: bool, debug: bool) -> None:
    """A server face's body (`serve`, `wyoming`): its `main` gets the server's own settings,
    then the model's options by name (`settings.resolve`); imported only when it runs."""
    reporter = Reporter(verbose=verbose, debug=debug)

    def body() -> int:
        import importlib

        return importlib.import_module(module).main({**serving, **options.given()}, config,
                                                    reporter)

    run_command(reporter, body)
