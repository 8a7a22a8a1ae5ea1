"""The other commands: `status` (an output folder's progress), `download` (the checkpoints),
`selftest` (a seconds-long run on the tiny preset) and `serve` (the OpenAI-compatible API)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from mimo_tts.cli.params import Debug, SelftestJson, ServeQuiet, StatusJson, Verbose, takes
from mimo_tts.cli.report import Reporter, run_command
from mimo_tts.errors import EXIT_OK, AudioCheckError
from mimo_tts.presets import TINY
from mimo_tts.runtime import checkpoints
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL, DEFAULT_TOKENIZER
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE
from mimo_tts.synthesis.markup import DEFAULT_SENTENCE_SILENCE
from mimo_tts.synthesis.options import DEFAULT_TASK, SynthesisOptions
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
                             "OUTPUT_DIR).")] = DEFAULT_TASK,
    seed: Annotated[int, typer.Option(
        metavar="SEED", help="synth's --seed: with --input it names and keys the items "
                             "(default 0).")] = 0,
    instruct: Annotated[str | None, typer.Option(
        metavar="TEXT", help="synth's --instruct, likewise.")] = None,
    prompt_audio: Annotated[str | None, typer.Option(
        metavar="FILE", help="synth's --prompt-audio, likewise.")] = None,
    voice: Annotated[str | None, typer.Option(
        metavar="NAME", help="synth's --voice, likewise.")] = None,
    captions: Annotated[bool, typer.Option(
        "--captions", help="The run had synth's --captions (any formats), likewise.")] = False,
    speed: Annotated[float, typer.Option(
        metavar="FACTOR", help="synth's --speed, likewise (off 1 it is in the id).")] = 1.0,
    sentence_silence: Annotated[float, typer.Option(
        metavar="SECONDS", help="synth's --sentence-silence, likewise (off 0.32 it is in the "
                                "id).")] = DEFAULT_SENTENCE_SILENCE,
    merge: Annotated[bool, typer.Option(
        "--merge", help="Write every shard's lines into one results.jsonl.")] = False,
    as_json: StatusJson = False, debug: Debug = False,
) -> None:
    """Done / failed / missing items across all shards' manifests of an output folder.

    Give it synth's --input and the --seed, --instruct, --prompt-audio, --voice, --captions,
    --speed and --sentence-silence the run had: they name the items. A book's folder
    (mimo-tts book) names its own pieces, with a line per chapter. Exits 0 when every item is
    done, 10 when some are failed or missing.
    """
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts.batch import status as folder_status
        from mimo_tts.batch.items import Naming
        from mimo_tts.batch.plan import variant_of
        from mimo_tts.book import status as book_status

        # checked as synth checks them (a value out of range: exit 2)
        variant = variant_of(SynthesisOptions(speed=speed, sentence_silence=sentence_silence))

        if not input and book_status.is_book(output_dir):
            report, lines = book_status.report(output_dir, merge), book_status.lines
        else:
            report = folder_status.report(output_dir, task, input or [], merge,
                                          Naming(seed, instruct, prompt_audio, task,
                                                 voice, captions, variant))
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


@takes("selftest")
def selftest(*, lm_device: str | None, tokenizer_device: str | None,
             as_json: SelftestJson = False, debug: Debug = False) -> None:
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


@takes("serve")
def serve(*, serving: dict, options: OptionValues, config: str | None, quiet: ServeQuiet = False,
          verbose: Verbose = False, debug: Debug = False) -> None:
    """Serve an OpenAI-compatible speech API: POST /v1/audio/speech (needs the serve extra).

    Each request is one line on stderr when it ends (method, path, status, voice, characters,
    audio seconds, time to first audio, total; never the text or the key); -q silences it."""
    run_server("mimo_tts.server.app", serving, os.environ, options, config, verbose, debug,
               quiet)


def run_server(module: str, serving: dict, environ, options: OptionValues, config: str | None,
               verbose: bool, debug: bool, quiet: bool = False,
               port: int | None = None) -> None:
    """A server face's body (`serve`, `wyoming`): once its extra is there, its `main` gets the
    server's own options (`ServeConfig`, the key from `environ`) and the model's
    (`OptionValues`); imported only when it runs."""
    reporter = Reporter(quiet=quiet, verbose=verbose, debug=debug)

    def body() -> int:
        import importlib

        from mimo_tts.server.protocol import serve_config

        face = importlib.import_module(module)
        face.require_extra()
        return face.main(serve_config(serving, environ, port), options, config, reporter)

    run_command(reporter, body)
