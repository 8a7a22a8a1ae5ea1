"""Command bodies behind the CLI: synth (prepare, run, summarise), preflight, decode, selftest.

`cli.py` parses flags and reports; these functions build options, run the pipeline and return
typed results. Imported lazily by the CLI: torch is only imported by the paths that need it
(`preflight` reads JSON and safetensors headers only).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from mimo_tts import io as mio
from mimo_tts import memory, models
from mimo_tts.devices import resolve_placement
from mimo_tts.errors import AudioCheckError, MimoTTSError, OutputError, UsageError
from mimo_tts.inputs import Item, read_items
from mimo_tts.options import SynthOptions, build_options, load_profile, option_flags
from mimo_tts.outputs import OutputDir
from mimo_tts.pipeline import Synthesizer
from mimo_tts.results import PAUSE_FRAMES, ItemResult, check_audio, join_pieces


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


# --- synth --------------------------------------------------------------------------------------


def prepare_synth(flags: Mapping[str, object], config: str | None, stdin, log):
    """Options (flag > profile > default), items and a Synthesizer; usage errors up front."""
    profile = load_profile(config)
    options = build_options(option_flags(flags), profile)
    _check_task(options)
    _check(not (options.stream and options.batch_size > 1),
           "--stream generates one prompt at a time; drop --batch-size")
    _check(not (options.raw and options.sample_rate != mio.SAMPLE_RATE),
           "--raw streams 24 kHz PCM; --sample-rate cannot be used with it")
    _check(not (flags.get("as_json") and options.to_stdout),
           "--json prints to stdout, which -o - / --raw already use")
    items = read_items(flags.get("text") or [], flags.get("input") or [], stdin)
    _check(bool(items), "nothing to say: give --text, --input FILE or --input -")
    _check(options.output is None or options.raw or len(items) == 1,
           f"-o/--output takes exactly one item, got {len(items)}; use --output-dir")
    return items, options, Synthesizer(options, profile, log=log)


def _check_task(options: SynthOptions) -> None:
    """The task exists and takes the --instruct / --prompt-audio given (every item would fail)."""
    from mimo_tts.tasks import TASKS

    spec = TASKS.get(options.task)
    _check(spec is not None, f"unknown --task {options.task!r}; choose one of "
                             f"{', '.join(TASKS)}")
    _check(not (options.prompt_audio and spec.prompt_audio == "none"),
           f"--prompt-audio: task {spec.name} takes no voice prompt; use tts_sft_with_audio")
    _check(not (options.instruct and spec.instruct == "none"),
           f"--instruct: task {spec.name} takes no instruction; use tts_sft_with_instruct")


def run_synth(synth: Synthesizer, items: list[Item]) -> Iterator[ItemResult]:
    """Run items into the output directory (locked) or to stdout / a single file."""
    o = synth.options
    synth.resolve()  # a missing checkpoint ends the run here, before any item (exit 3)
    sink = mio.RawPcmSink().write if o.raw else None
    if o.to_stdout or o.output:
        target = Path(o.output) if o.output and not o.to_stdout else None
        if target is not None and target.exists() and not mio.is_special_file(target) \
                and not o.overwrite:
            raise OutputError(f"{o.output} exists; use --overwrite to replace it")
        yield from synth.run(items, None, sink)
        return
    with OutputDir(o.output_dir, o.task, o.format) as out:
        yield from synth.run(items, out, sink)


def summary(results: list[ItemResult], synth: Synthesizer, elapsed: float) -> str:
    """One line: counts, load time, synthesis time, audio seconds and real-time factor."""
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "skipped", "error")}
    audio = sum(r.seconds for r in results if r.status == "ok")
    load = synth.timings.get("load_s")
    busy = elapsed - (load or 0.0)
    parts = [f"{counts['ok']} written, {counts['skipped']} skipped, {counts['error']} failed"]
    if load is not None:
        parts.append(f"load {load:.2f} s")
    if audio:
        parts.append(f"synthesis {busy:.2f} s for {audio:.2f} s of audio "
                     f"(RTF {busy / audio:.3f})")
    return " | ".join(parts)


def preflight(flags: Mapping[str, object], config: str | None) -> dict:
    profile = load_profile(config)
    options = build_options(option_flags(flags), profile)
    synth = Synthesizer(options, profile)
    texts = [t for t in flags.get("text") or [] if t != "-"]
    if texts:
        synth.lengths = memory.Lengths.for_run(texts, options.batch_size, options.max_chars,
                                               options.max_new_groups)
    return synth.preflight()


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


def decode_files(flags: Mapping[str, object], log) -> Iterator[DecodeResult]:
    """`mimo-tts decode`: saved codes -> audio files, decoded on the tokenizer device.

    A bad codes file (unreadable, codes out of range, audio failing its check) fails alone;
    the other files are still decoded.
    """
    from mimo_tts.codec import load_audio_tokenizer

    paths = [Path(p) for p in flags["codes"]]
    output, fmt = flags.get("output"), flags.get("format") or "wav"
    _check(fmt in mio.FORMATS, f"--format must be one of {', '.join(mio.FORMATS)}")
    _check(output is None or len(paths) == 1, "-o/--output takes exactly one codes file")
    loaded = {p: _try(lambda p=p: mio.load_codes(p)) for p in paths}
    first = next((v for v in loaded.values() if not isinstance(v, MimoTTSError)), None)
    placement = resolve_placement(tokenizer_device=flags.get("tokenizer_device"),
                                  tokenizer_dtype=flags.get("tokenizer_dtype"),
                                  cuda_graph=flags.get("cuda_graph"))
    codec = None
    if first is not None:  # at least one readable file: load the tokenizer once
        tok = _decode_tokenizer(flags.get("tokenizer"), first[1])
        log(f"decoding with {tok.path} on {placement.tokenizer_device.value}")
        codec = load_audio_tokenizer(tok.path, placement.tokenizer_device.value,
                                     placement.tokenizer_dtype.value,
                                     cuda_graph=bool(placement.cuda_graph.value))
    for path, found in loaded.items():
        result = DecodeResult(path)
        try:
            if isinstance(found, MimoTTSError):
                raise found
            result.path = _decode_one(codec, path, *found, output, fmt, flags)
        except MimoTTSError as exc:
            result.error, result.exit_code = str(exc), exc.exit_code
        yield result


def _try(fn):
    try:
        return fn()
    except MimoTTSError as exc:
        return exc


def _decode_one(codec, path: Path, pieces: list, meta: dict, output, fmt: str, flags):
    from mimo_tts.engine import oom_advice

    rate = flags.get("sample_rate") or mio.SAMPLE_RATE
    with oom_advice("Stage-1 decode", str(codec.device)):
        waves = codec.decode_batch(pieces)
    audio = join_pieces(waves, int(meta.get("pause_frames", PAUSE_FRAMES)),
                        codec.samples_per_frame)
    check_audio(audio, path.name)
    samples = mio.resample(audio, mio.SAMPLE_RATE, rate)
    if output == "-":
        mio.write_stdout_audio(samples, rate, fmt)
        return None
    stem = path.name.removesuffix(".safetensors").removesuffix(".codes")
    target = Path(output) if output else path.with_name(stem + ".decoded" + mio.FORMATS[fmt][2])
    return mio.write_audio(target, samples, rate, fmt)


def _decode_tokenizer(flag: str | None, meta: dict):
    """flag > MIMO_AUDIO_TOKENIZER_PATH > the directory recorded in the codes > default."""
    (_, _), (name, source) = models.pick_names(None, flag)
    recorded = meta.get("tokenizer")
    if source == "default" and recorded and Path(recorded).is_dir():
        name, source = recorded, "codes metadata"
    return models.resolve(name, source, "tokenizer")


# --- selftest -----------------------------------------------------------------------------------


def selftest(lm_device: str | None, tokenizer_device: str | None, log) -> dict:
    """End-to-end on the tiny preset in a temp dir; checks rate, length, finiteness, level."""
    import tempfile

    import soundfile as sf

    with tempfile.TemporaryDirectory(prefix="mimo-tts-selftest-") as tmp:
        options = SynthOptions(model=models.TINY, lm_device=lm_device or "cpu",
                               tokenizer_device=tokenizer_device or "cpu", output_dir=tmp,
                               save_codes=True).validate()
        synth = Synthesizer(options, log=log)
        item = Item(id="selftest", text="Hello from MiMo.", source="selftest")
        (result,) = list(run_synth(synth, [item]))
        if result.status != "ok":
            error = AudioCheckError(f"selftest failed: {result.error}")
            error.exit_code = result.exit_code
            raise error
        audio, rate = sf.read(str(result.path), dtype="float32")
        pieces, _ = mio.load_codes(result.codes_path)
        frames = sum(p.shape[1] for p in pieces) + PAUSE_FRAMES * (len(pieces) - 1)
        problems = _selftest_problems(audio, rate, frames)
        if problems:
            raise AudioCheckError("selftest failed: " + "; ".join(problems))
        peak = float(abs(audio).max())
        return {"status": "ok", "seconds": len(audio) / rate, "frames": frames, "peak": peak,
                "rtf": result.rtf, "load_s": synth.timings.get("load_s"),
                "path": "(temporary) " + result.path.name}


def _selftest_problems(audio, rate: int, frames: int) -> list[str]:
    import numpy as np

    problems = []
    if rate != mio.SAMPLE_RATE:
        problems.append(f"sample rate {rate} != {mio.SAMPLE_RATE}")
    if len(audio) != frames * 960:
        problems.append(f"{len(audio)} samples != 960 x {frames} frames")
    if not np.isfinite(audio).all():
        problems.append("non-finite samples")
    if float(np.abs(audio).max(initial=0.0)) < 1e-3:
        problems.append("silent output")
    if not 0.5 <= len(audio) / mio.SAMPLE_RATE <= 60:
        problems.append(f"implausible length {len(audio) / mio.SAMPLE_RATE:.2f} s")
    return problems
