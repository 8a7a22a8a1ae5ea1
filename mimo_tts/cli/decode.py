"""`mimo-tts decode`: Stage-1 alone, saved codes -> audio files on the tokenizer device.

Each codes file is a result of its own: a bad one (unreadable, codes out of range, audio
failing its check) fails alone and the others are still decoded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from mimo_tts import presets
from mimo_tts.batch.files import load_codes
from mimo_tts.batch.sinks import FileSink, StdoutSink
from mimo_tts.cli.params import OUT, Debug, Quiet, takes
from mimo_tts.cli.report import Reporter, run_command
from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.synthesis.audio import (
    FORMATS,
    PAUSE_FRAMES,
    SAMPLE_RATE,
    check_format_rate,
    output_format,
    resample,
)
from mimo_tts.synthesis.preflight import lengths_for
from mimo_tts.synthesis.settings import OptionValues, resolve


@takes("decode")
def decode(
    codes: Annotated[list[str], typer.Argument(
        metavar="CODES", help="Codes file(s) written by --save-codes.")],
    *, options: OptionValues,
    output: Annotated[str | None, typer.Option("--output", "-o", rich_help_panel=OUT,
        metavar="FILE",
        help="Output file ('-' = stdout); default <codes stem>.decoded.wav beside the codes.")
    ] = None,
    format: str | None, sample_rate: int | None,
    overwrite: Annotated[bool, typer.Option("--overwrite", rich_help_panel=OUT,
        help="Replace existing output files (kept otherwise: that file fails, exit 5).")
    ] = False,
    quiet: Quiet = False, debug: Debug = False,
) -> None:
    """Stage-1 alone: decode saved codes to audio on the tokenizer device.

    A bad file (unreadable, codes out of range, audio failing its check) fails alone.
    """
    reporter = Reporter(quiet=quiet, debug=debug, stdout_data=output != "-")

    def body() -> int:
        from mimo_tts.batch.results import exit_code_for

        results = []
        for result in decode_files(codes, options, reporter.log, output=output, fmt=format,
                                   sample_rate=sample_rate, overwrite=overwrite):
            results.append(result)
            if result.error is not None:
                reporter.err.print(f"failed {result.source}: {result.error}", markup=False)
            elif result.path is not None and reporter.stdout_data:
                reporter.data(str(result.path))
        return exit_code_for(results)

    run_command(reporter, body)


@dataclass
class DecodeResult:
    """One codes file of `mimo-tts decode`: the written path, or the error and its exit code."""

    source: Path
    path: Path | None = None
    error: str | None = None
    exit_code: int = 0

    @property
    def status(self) -> str:
        return "error" if self.error is not None else "ok"


def decode_files(codes: list[str], options: OptionValues, log, *, output: str | None = None,
                 fmt: str | None = None, sample_rate: int | None = None,
                 overwrite: bool = False) -> Iterator[DecodeResult]:
    """`mimo-tts decode`: saved codes -> audio files, decoded on the tokenizer device that
    `options` (the tokenizer's flags) resolve to.

    The tokenizer loads through `Stage1.from_settings`: a decode that cannot fit is refused
    (exit 4) before loading. A bad codes file fails alone (the module docstring); an existing
    output is kept unless `overwrite`.
    """
    from mimo_tts.batch.plan import check_binary_stdout
    from mimo_tts.synthesis.stage1 import Stage1

    paths, rate = [Path(p) for p in codes], sample_rate or SAMPLE_RATE
    fmt = output_format(output, fmt)
    check_format_rate(fmt, rate)
    if output is not None and len(paths) != 1:
        raise UsageError("-o/--output takes exactly one codes file")
    check_binary_stdout(output == "-", "-o -")
    loaded = {p: _try(lambda p=p: load_codes(p)) for p in paths}
    first = next((v for v in loaded.values() if not isinstance(v, MimoTTSError)), None)
    settings = resolve(options)  # flag > env > default, as synth resolves them
    stage1 = None
    if first is not None:  # at least one readable file: load the tokenizer once
        ref = _decode_tokenizer(settings, first[1])
        log(f"decoding with {ref.path} on {settings.placement.tokenizer_device.value}")
        stage1 = Stage1.from_settings(settings, ref, log,  # decodes: encodes nothing
                                      lengths=lengths_for(settings, [], encodes=False))
    for path, found in loaded.items():
        result = DecodeResult(path)
        try:
            if isinstance(found, MimoTTSError):
                raise found
            pieces, meta = found
            stem = path.name.removesuffix(".safetensors").removesuffix(".codes")
            sink = StdoutSink(fmt, rate) if output == "-" else FileSink(
                output or path.with_name(stem + ".decoded" + FORMATS[fmt][2]), fmt, rate,
                overwrite=overwrite, audio_only=True)
            with sink:
                sink.check(result)  # an existing file is kept: before any decoding
                pauses = meta.get("pause_samples") or stage1.frame_pauses(
                    len(pieces), int(meta.get("pause_frames", PAUSE_FRAMES)))
                audio = stage1.join(pieces, pauses, path.name)
                sink.write(result, resample(audio, SAMPLE_RATE, rate), {}, {})
        except MimoTTSError as exc:
            result.error, result.exit_code = str(exc), exc.exit_code
        yield result


def _try(fn):
    try:
        return fn()
    except MimoTTSError as exc:
        return exc


def _decode_tokenizer(settings, meta: dict):
    """flag > MIMO_AUDIO_TOKENIZER_PATH > the directory recorded in the codes > default."""
    name, source = settings.checkpoints.tokenizer
    recorded = meta.get("tokenizer")
    if source == "default" and recorded and Path(recorded).is_dir():
        name, source = recorded, "codes metadata"
    return presets.resolve(name, source, "tokenizer")
