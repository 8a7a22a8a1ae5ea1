"""Command bodies behind the CLI: synth (prepare, run into a sink, summarise), decode, selftest.

`cli.py` parses flags and reports; these functions resolve options once (`options.resolve`),
pick the one sink a run writes through and run the batch runner. Imported lazily by the CLI:
torch is only imported by the paths that need it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from mimo_tts import presets
from mimo_tts.batch import files as mio
from mimo_tts.batch.items import Item, read_items
from mimo_tts.batch.results import ItemResult
from mimo_tts.batch.runner import BatchRunner
from mimo_tts.batch.sinks import DirectorySink, FileSink, RawPcmSink, StdoutSink
from mimo_tts.errors import AudioCheckError, MimoTTSError, UsageError
from mimo_tts.runtime.devices import resolve_placement
from mimo_tts.synthesis.audio import (
    FORMATS,
    PAUSE_FRAMES,
    SAMPLE_RATE,
    check_format_rate,
    output_format,
    resample,
)
from mimo_tts.synthesis.options import (
    Settings,
    pick_names,
    place,
    resolve,
    resolve_options,
    with_shard,
)
from mimo_tts.synthesis.preflight import preflight
from mimo_tts.synthesis.profiles import load_profile


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


# --- synth --------------------------------------------------------------------------------------


def _check_binary_stdout(to_stdout: bool, flag: str) -> None:
    """Audio bytes are never dumped on a terminal (like gzip): pipe or redirect stdout."""
    _check(not (to_stdout and os.isatty(1)),
           f"{flag} writes audio bytes to stdout, which is a terminal; pipe it (| aplay) or "
           "redirect it (> file)")


def settings_for(flags: Mapping[str, object], config: str | None) -> Settings:
    """The command's options, resolved once: flag > env > profile > default."""
    return resolve(flags, load_profile(config), os.environ)


def prepare_synth(flags: Mapping[str, object], config: str | None, stdin, log):
    """Settings, items and a BatchRunner; usage errors up front, then input errors, then
    device and checkpoint-name errors."""
    profile = load_profile(config)
    settings = resolve_options(flags, profile)
    run = settings.run
    _check(not (flags.get("as_json") and run.to_stdout),
           "--json prints to stdout, which -o - / --raw already use")
    _check_binary_stdout(run.to_stdout, "--raw" if run.raw else "-o -")
    items = read_items(flags.get("text") or [], flags.get("input") or [], stdin)
    _check(bool(items), "nothing to say: give --text, --input FILE or --input -")
    _check(run.output is None or run.raw or len(items) == 1,
           f"-o/--output takes exactly one item, got {len(items)}; use --output-dir")
    settings = place(settings, flags, profile, os.environ)
    if run.output or run.raw:
        _check(flags.get("shard") is None, "--shard splits an --output-dir run; drop -o/--raw")
    else:  # shard K of N takes its part of the items (shards.py)
        settings = with_shard(settings, flags, os.environ)
    shard = settings.shard
    if shard is not None:
        items = [i for i in items if shard.owns(i.id)]
        log(f"shard {shard.label} ({shard.source}): {len(items)} items")
    return items, settings, BatchRunner(settings, log=log)


def sink_for(settings: Settings):
    """The one sink a synth run writes through: raw PCM, stdout, one file or a directory."""
    run = settings.run
    if run.raw:
        return RawPcmSink(streamed=run.stream)
    if run.output == "-":
        return StdoutSink(run.format, run.sample_rate)
    if run.output:
        return FileSink(run.output, run.format, run.sample_rate, run.save_codes, run.overwrite)
    return DirectorySink(run.output_dir, settings.synthesis.task, run.format, run.sample_rate,
                         run.save_codes, run.overwrite, settings.shard)


def run_synth(runner: BatchRunner, items: list[Item], sink=None) -> Iterator[ItemResult]:
    """Run items through the sink (default: the one the settings ask for)."""
    runner.resolve()  # a missing checkpoint ends the run here, before any item (exit 3)
    with sink or sink_for(runner.settings) as opened:
        yield from runner.run(items, opened)


def summary(results: list[ItemResult], runner: BatchRunner, elapsed: float) -> str:
    """One line: counts, load time, synthesis time, audio seconds and real-time factor."""
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "skipped", "error")}
    audio = sum(r.seconds for r in results if r.status == "ok")
    load = runner.timings.get("load_s")
    busy = elapsed - (load or 0.0)
    parts = [f"{counts['ok']} written, {counts['skipped']} skipped, {counts['error']} failed"]
    if load is not None:
        parts.append(f"load {load:.2f} s")
    if audio:
        parts.append(f"synthesis {busy:.2f} s for {audio:.2f} s of audio "
                     f"(RTF {busy / audio:.3f})")
    return " | ".join(parts)


def preflight_report(flags: Mapping[str, object], config: str | None) -> dict:
    """The preflight of the run these flags describe: the `--input` files are read and checked
    as a run reads them (stdin is left alone), and their texts with `--text` size the memory
    plan."""
    texts = [t for t in flags.get("text") or [] if t != "-"]
    files = [f for f in flags.get("input") or [] if f != "-"]
    settings = settings_for(flags, config)
    items = read_items([], files) if files else []
    if not (settings.run.output or settings.run.raw):
        settings = with_shard(settings, flags, os.environ)
    report = preflight(settings, texts + [i.text for i in items if isinstance(i.text, str)])
    if files:
        report["inputs"] = {"files": files, "items": len(items),
                            "bad_items": sum(i.error is not None for i in items)}
    return report


# --- decode -------------------------------------------------------------------------------------


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


def decode_files(codes: list[str], log, *, output: str | None = None, fmt: str | None = None,
                 sample_rate: int | None = None, tokenizer: str | None = None,
                 tokenizer_device: str | None = None, tokenizer_dtype: str | None = None,
                 cuda_graph: bool | None = None,
                 overwrite: bool = False) -> Iterator[DecodeResult]:
    """`mimo-tts decode`: saved codes -> audio files, decoded on the tokenizer device.

    A bad codes file (unreadable, codes out of range, audio failing its check) fails alone;
    the other files are still decoded. An existing output is kept unless `overwrite`.
    """
    from mimo_tts.synthesis.stage1 import Stage1

    paths, rate = [Path(p) for p in codes], sample_rate or SAMPLE_RATE
    fmt = output_format(output, fmt)
    check_format_rate(fmt, rate)
    _check(output is None or len(paths) == 1, "-o/--output takes exactly one codes file")
    _check_binary_stdout(output == "-", "-o -")
    loaded = {p: _try(lambda p=p: mio.load_codes(p)) for p in paths}
    first = next((v for v in loaded.values() if not isinstance(v, MimoTTSError)), None)
    placement = resolve_placement(tokenizer_device=tokenizer_device,
                                  tokenizer_dtype=tokenizer_dtype, cuda_graph=cuda_graph)
    stage1 = None
    if first is not None:  # at least one readable file: load the tokenizer once
        tok = _decode_tokenizer(tokenizer, first[1])
        log(f"decoding with {tok.path} on {placement.tokenizer_device.value}")
        stage1 = Stage1.load(tok.path, placement, lambda m: None)
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
                audio = stage1.join(pieces, int(meta.get("pause_frames", PAUSE_FRAMES)),
                                    path.name)
                sink.write(result, resample(audio, SAMPLE_RATE, rate), {}, {})
        except MimoTTSError as exc:
            result.error, result.exit_code = str(exc), exc.exit_code
        yield result


def _try(fn):
    try:
        return fn()
    except MimoTTSError as exc:
        return exc


def _decode_tokenizer(flag: str | None, meta: dict):
    """flag > MIMO_AUDIO_TOKENIZER_PATH > the directory recorded in the codes > default."""
    (_, _), (name, source) = pick_names(None, flag)
    recorded = meta.get("tokenizer")
    if source == "default" and recorded and Path(recorded).is_dir():
        name, source = recorded, "codes metadata"
    return presets.resolve(name, source, "tokenizer")


# --- selftest -----------------------------------------------------------------------------------


def selftest(lm_device: str | None, tokenizer_device: str | None, log) -> dict:
    """End-to-end on the tiny preset in a temp dir; checks rate, length, finiteness, level."""
    import tempfile

    import soundfile as sf

    with tempfile.TemporaryDirectory(prefix="mimo-tts-selftest-") as tmp:
        settings = resolve({"model": presets.TINY, "lm_device": lm_device or "cpu",
                            "tokenizer_device": tokenizer_device or "cpu", "output_dir": tmp,
                            "save_codes": True})
        runner = BatchRunner(settings, log=log)
        item = Item(id="selftest", text="Hello from MiMo.", source="selftest")
        (result,) = list(run_synth(runner, [item]))
        if result.status != "ok":
            error = AudioCheckError(f"selftest failed: {result.error}")
            error.exit_code = result.exit_code
            raise error
        audio, rate = sf.read(str(result.path), dtype="float32")
        pieces, _ = mio.load_codes(result.codes_path)
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
