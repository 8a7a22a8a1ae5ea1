"""`mimo-tts`: the command line (Typer + rich). Thin: parse -> options -> batch runner -> report.

Data goes to stdout (written paths, `--json` lines, audio with `-o -`/`--raw`); logs, progress
and errors go to stderr. torch is never imported here: the command bodies (`commands.py`) are
imported inside the commands, and `--help`, `devices` and `synth --dry-run` never import it.
Errors are one `Error:` line with a documented exit code (README "Exit codes", and
docs/reliability.md); `--debug` adds the traceback. SIGINT, SIGTERM and SIGHUP stop a run
after cleaning up (exit 130): finished items are kept and a re-run resumes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console

from mimo_tts import __version__
from mimo_tts.errors import (
    EXIT_BUG,
    EXIT_CHECKPOINT,
    EXIT_DEVICE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    MimoTTSError,
)
from mimo_tts.io import write_stdout_line

EXAMPLES = """\
[b]Examples[/b]

  mimo-tts synth --model tiny --text "Hello from MiMo"
  mimo-tts synth --text "Hello" --tokenizer-device cpu
  mimo-tts synth --input lines.txt --output-dir out --save-codes
  mimo-tts synth --task tts_sft_with_instruct --instruct "calm, low voice" -t "Good night"
  echo "Streaming" | mimo-tts synth --input - --stream --raw | aplay -f S16_LE -r 24000
  mimo-tts decode out/tts_sft/hello.codes.safetensors --tokenizer-device cpu
  mimo-tts synth --engine vllm --input lines.txt --max-num-seqs 16
  mimo-tts devices --tokenizer-device cpu
"""
IN, MODELS, DEV, GEN, OUT, RUN = "Inputs", "Models", "Devices", "Generation", "Outputs", "Run"
VLLM = "vLLM engine"

app = typer.Typer(
    name="mimo-tts", no_args_is_help=True, rich_markup_mode="rich", epilog=EXAMPLES,
    pretty_exceptions_enable=False,
    help="Offline text-to-speech with Xiaomi MiMo-Audio: Stage-0 LM -> codes, Stage-1 -> wav.",
)

# --- shared option types ------------------------------------------------------------------------
Model = Annotated[str | None, typer.Option(
    "--model", "-m", rich_help_panel=MODELS,
    help="LM checkpoint: a directory, a Hugging Face id (local cache) or 'tiny' (built-in preset). "
         "Default XiaomiMiMo/MiMo-Audio-7B-Instruct.")]
Tokenizer = Annotated[str | None, typer.Option(
    rich_help_panel=MODELS, help="Audio tokenizer: a directory or HF id (default "
    "XiaomiMiMo/MiMo-Audio-Tokenizer; env MIMO_AUDIO_TOKENIZER_PATH).")]
LmDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, help="Stage-0 device: cpu, cuda, cuda:N, mps (env MIMO_TTS_LM_DEVICE).")]
TokDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, help="Stage-1 device (env MIMO_AUDIO_TOKENIZER_DEVICE).")]
Dtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, help="LM dtype: auto (default: the checkpoint's, where the device runs "
    "it natively), float32, bfloat16, float16 (env MIMO_TTS_DTYPE).")]
TokDtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, help="Tokenizer dtype: auto (default), float32, bfloat16, float16 "
    "(env MIMO_TTS_TOKENIZER_DTYPE).")]
NoMemoryCheck = Annotated[bool | None, typer.Option(
    "--no-memory-check", rich_help_panel=DEV, show_default=False,
    help="Load even when the memory preflight says the run does not fit (exit 4 otherwise).")]
LmThreads = Annotated[int | None, typer.Option(
    rich_help_panel=DEV, help="CPU threads for Stage-0 (default: torch's; --stream on one CPU "
    "splits the cores between the stages).")]
TokThreads = Annotated[int | None, typer.Option(
    rich_help_panel=DEV, help="CPU threads for Stage-1 decode and prompt encode.")]
Graph = Annotated[bool | None, typer.Option(
    "--cuda-graph/--no-cuda-graph", rich_help_panel=DEV, show_default=False,
    help="CUDA-graph decode on CUDA (env MIMO_AUDIO_TOKENIZER_CUDA_GRAPH; never on CPU).")]
EngineName = Annotated[str | None, typer.Option(
    rich_help_panel=VLLM, help="Stage-0 engine: native (default) or vllm (needs "
    "pip install 'mimo-tts[vllm]'; without it exit 2). Stage-1 stays on the tokenizer device.")]
Config = Annotated[str | None, typer.Option(
    "--config", "-c", rich_help_panel=RUN,
    help="TOML profile: a path, or a name in ~/.config/mimo-tts (MIMO_TTS_CONFIG_DIR) or the "
         "built-in default, cpu-tokenizer, ci-smoke.")]
Fmt = Annotated[str | None, typer.Option(
    "--format", rich_help_panel=OUT, help="wav (PCM16, default), wav-float or flac.")]
Rate = Annotated[int | None, typer.Option(
    rich_help_panel=OUT, help="Resample the output to this rate (default 24000).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=RUN,
                                     help="Only errors on stderr.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", rich_help_panel=RUN,
                                       help="More detail on stderr (loading, placement).")]
AsJson = Annotated[bool, typer.Option("--json", rich_help_panel=RUN,
                                      help="One JSON object per item on stdout.")]
Debug = Annotated[bool, typer.Option("--debug", rich_help_panel=RUN,
                                     help="Show tracebacks for errors.")]


class Reporter:
    """Where messages go: stderr for logs/progress/errors, stdout for data."""

    def __init__(self, quiet=False, verbose=False, as_json=False, debug=False, stdout_data=True):
        self.quiet, self.verbose, self.as_json, self.debug = quiet, verbose, as_json, debug
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.stdout_data = stdout_data and not as_json
        self.progress = None

    def log(self, message: str) -> None:
        if self.verbose and not self.quiet:
            self.err.print(message, markup=False)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, markup=False)

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]Error:[/bold red] {message}" if self.err.is_terminal
                       else f"Error: {message}", markup=self.err.is_terminal, highlight=False)

    def data(self, obj) -> None:
        """A JSON object (with --json) or a plain line on stdout."""
        text = json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else str(obj)
        write_stdout_line(text)

    @contextmanager
    def bar(self, total: int):
        """A progress bar on stderr, only on a terminal and never with --quiet/--json."""
        if self.quiet or self.as_json or not self.err.is_terminal or total < 2:
            yield lambda: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=self.err,
                      transient=True) as progress:
            task = progress.add_task("synthesising", total=total)
            yield lambda: progress.advance(task)

    def item(self, result, task: str) -> None:
        record = result.record(task)
        if self.as_json:
            self.data(record)
        elif result.status == "error":
            self.err.print(f"failed {result.item.id}: {result.error}", markup=False)
        elif result.status == "skipped":
            self.log(f"skipped {result.path} (done with the same inputs)")
        elif result.path is not None and self.stdout_data and not self.quiet:
            self.data(str(result.path))


def run_command(reporter: Reporter, body) -> None:
    """Run a command body, mapping typed errors and interrupts to one line and an exit code."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupt)
    try:
        code = body()
    except MimoTTSError as exc:
        if reporter.debug:
            reporter.err.print_exception()
        reporter.error(str(exc))
        code = exc.exit_code
    except KeyboardInterrupt:
        reporter.error("interrupted; finished items are kept: re-run the same command to resume")
        code = EXIT_INTERRUPTED
    except Exception as exc:  # a bug: say so, with the trace under --debug
        if reporter.debug:
            reporter.err.print_exception()
        reporter.error(f"unexpected {type(exc).__name__}: {exc} (re-run with --debug)")
        code = EXIT_BUG
    raise typer.Exit(code or EXIT_OK)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mimo-tts {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Offline text-to-speech with Xiaomi MiMo-Audio."""


@app.command(epilog=EXAMPLES)
def synth(
    text: Annotated[list[str] | None, typer.Option(
        "--text", "-t", rich_help_panel=IN, help="Text to speak (repeatable; '-' reads stdin).")
    ] = None,
    input: Annotated[list[str] | None, typer.Option(
        "--input", "-i", rich_help_panel=IN,
        help=".txt (one item per line) or .jsonl (id, text, instruct, prompt_audio, seed); "
             "'-' reads stdin.")] = None,
    task: Annotated[str | None, typer.Option(rich_help_panel=IN, help="Prompt task: tts_sft, "
        "tts_sft_with_instruct, tts_sft_with_audio, tts_sft_with_natural_instruction.")] = None,
    instruct: Annotated[str | None, typer.Option(rich_help_panel=IN,
                                                 help="Style instruction.")] = None,
    prompt_audio: Annotated[str | None, typer.Option(rich_help_panel=IN,
                                                     help="Voice prompt audio file.")] = None,
    template: Annotated[int | None, typer.Option(rich_help_panel=IN,
        help="Fix the instruction template index (default: drawn from the seed).")] = None,
    max_chars: Annotated[int | None, typer.Option(rich_help_panel=IN,
        help="Split longer text on sentence ends (default 300; 0 = never).")] = None,
    model: Model = None,
    tokenizer: Tokenizer = None,
    allow_download: Annotated[bool | None, typer.Option(
        "--allow-download/--offline", rich_help_panel=MODELS, show_default=False,
        help="Download missing checkpoints (default offline).")] = None,
    lm_device: LmDevice = None,
    tokenizer_device: TokDevice = None,
    dtype: Dtype = None,
    tokenizer_dtype: TokDtype = None,
    cuda_graph: Graph = None,
    no_memory_check: NoMemoryCheck = None,
    lm_quant: Annotated[str | None, typer.Option(rich_help_panel=DEV,
        help="Opt-in int8 weight-only LM on CPU (faster, slightly less exact; "
             "default off).")] = None,
    lm_threads: LmThreads = None,
    tokenizer_threads: TokThreads = None,
    seed: Annotated[int | None, typer.Option(rich_help_panel=GEN,
                                             help="Sampling seed (default 0).")] = None,
    temperature: Annotated[float | None, typer.Option(rich_help_panel=GEN,
        help="Text temperature (0 = greedy; task default 0.6).")] = None,
    top_k: Annotated[int | None, typer.Option(rich_help_panel=GEN, help="Text top-k.")] = None,
    top_p: Annotated[float | None, typer.Option(rich_help_panel=GEN, help="Text top-p.")] = None,
    audio_temperature: Annotated[float | None, typer.Option(rich_help_panel=GEN,
        help="Audio temperature (0 = greedy; task default 0.9).")] = None,
    audio_top_k: Annotated[int | None, typer.Option(rich_help_panel=GEN,
                                                    help="Audio top-k.")] = None,
    audio_top_p: Annotated[float | None, typer.Option(rich_help_panel=GEN,
                                                      help="Audio top-p.")] = None,
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN,
        help="Cap on generated groups (one group = 160 ms).")] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=GEN,
        help="Prompts generated together.")] = None,
    output_dir: Annotated[str | None, typer.Option(rich_help_panel=OUT,
        help="Root of <dir>/<task>/<id>.wav (default output_audio).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", rich_help_panel=OUT,
        help="One item: write to this file, or '-' for stdout.")] = None,
    format: Fmt = None,
    sample_rate: Rate = None,
    save_codes: Annotated[bool | None, typer.Option("--save-codes", rich_help_panel=OUT,
        help="Also write the Stage-0 codes (<id>.codes.safetensors).")] = None,
    overwrite: Annotated[bool | None, typer.Option("--overwrite", rich_help_panel=OUT,
        help="Redo items already done and replace existing files.")] = None,
    stream: Annotated[bool | None, typer.Option("--stream", rich_help_panel=OUT,
        help="Decode audio while the LM generates (streaming Stage-1).")] = None,
    raw: Annotated[bool | None, typer.Option("--raw", rich_help_panel=OUT,
        help="Stream 16-bit 24 kHz mono PCM to stdout as it is decoded.")] = None,
    stream_mode: Annotated[str | None, typer.Option(rich_help_panel=OUT,
        help="Streaming decoder: incremental (default: each frame decoded once, closest to "
             "one-shot) or official (re-decodes overlapping windows, spec §7.2).")] = None,
    engine: EngineName = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(rich_help_panel=VLLM,
        help="vLLM: share of GPU memory for weights + KV cache (default 0.9).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(rich_help_panel=VLLM,
        help="vLLM: prompts generated concurrently (default 32).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(rich_help_panel=VLLM,
        help="vLLM: GPUs to shard the LM over (default 1).")] = None,
    max_model_len: Annotated[int | None, typer.Option(rich_help_panel=VLLM,
        help="vLLM: longest sequence in groups, prompt included (default 8192).")] = None,
    config: Config = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", rich_help_panel=RUN,
        help="Preflight only (devices, checkpoints, memory); load nothing.")] = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Synthesise speech: text -> [b]output_audio/<task>/<id>.wav[/b] (+ sidecar, manifest)."""
    flags = dict(locals())
    reporter = Reporter(quiet, verbose, as_json, debug, stdout_data=not (raw or output == "-"))

    def body() -> int:
        if dry_run:
            return _preflight(reporter, flags, config)
        from mimo_tts import commands
        from mimo_tts.results import exit_code_for

        items, settings, runner = commands.prepare_synth(flags, config, sys.stdin, reporter.log)
        start = time.perf_counter()
        with runner, reporter.bar(len(items)) as advance:  # closes the engine (vLLM) at the end
            results = []
            for result in commands.run_synth(runner, items):
                results.append(result)
                reporter.item(result, settings.synthesis.task)
                advance()
        reporter.info(commands.summary(results, runner, time.perf_counter() - start))
        return exit_code_for(results)

    run_command(reporter, body)


def _preflight(reporter: Reporter, flags: dict, config: str | None) -> int:
    from mimo_tts import commands

    report = commands.preflight_report(flags, config)
    if reporter.as_json:
        reporter.data(report)
    else:  # the report is the command's data: pretty JSON on stdout
        Console(highlight=False).print_json(data=report)
    missing = [c for c in report["checkpoints"].values()
               if c["status"].startswith(("missing", "broken"))]
    for entry in missing:
        reporter.error(entry["status"].split(": ", 1)[-1])
    if missing:
        return EXIT_CHECKPOINT
    if report.get("memory_error") and not flags.get("no_memory_check"):
        reporter.error(report["memory_error"])
        return EXIT_DEVICE
    return EXIT_OK


@app.command()
def devices(
    model: Model = None, tokenizer: Tokenizer = None, lm_device: LmDevice = None,
    tokenizer_device: TokDevice = None, dtype: Dtype = None, tokenizer_dtype: TokDtype = None,
    cuda_graph: Graph = None, engine: EngineName = None, config: Config = None,
    no_memory_check: NoMemoryCheck = None, as_json: AsJson = False, debug: Debug = False,
) -> None:
    """Preflight: devices (and why), CUDA, graph policy, checkpoints, memory, Stage-0 engine.

    Loads no weights. Exits 3 when a checkpoint is missing, 4 on a bad device or when the
    default run would not fit in memory.
    """
    flags = dict(locals())
    reporter = Reporter(as_json=as_json, debug=debug)
    run_command(reporter, lambda: _preflight(reporter, flags, config))


@app.command()
def decode(
    codes: Annotated[list[str], typer.Argument(help="Codes file(s) written by --save-codes.")],
    tokenizer: Tokenizer = None, tokenizer_device: TokDevice = None,
    tokenizer_dtype: TokDtype = None, cuda_graph: Graph = None,
    output: Annotated[str | None, typer.Option("--output", "-o", rich_help_panel=OUT,
        help="Output file ('-' = stdout); default <codes stem>.decoded.wav beside the codes.")
    ] = None,
    format: Fmt = None, sample_rate: Rate = None, quiet: Quiet = False, debug: Debug = False,
) -> None:
    """Stage-1 alone: decode saved codes to audio on the tokenizer device.

    A bad file (unreadable, codes out of range, audio failing its check) fails alone.
    """
    reporter = Reporter(quiet=quiet, debug=debug, stdout_data=output != "-")

    def body() -> int:
        from mimo_tts import commands
        from mimo_tts.results import exit_code_for

        results = []
        for result in commands.decode_files(
                codes, reporter.log, output=output, fmt=format, sample_rate=sample_rate,
                tokenizer=tokenizer, tokenizer_device=tokenizer_device,
                tokenizer_dtype=tokenizer_dtype, cuda_graph=cuda_graph):
            results.append(result)
            if result.error is not None:
                reporter.err.print(f"failed {result.source}: {result.error}", markup=False)
            elif result.path is not None and reporter.stdout_data and not quiet:
                reporter.data(str(result.path))
        return exit_code_for(results)

    run_command(reporter, body)


@app.command()
def download(
    model: Annotated[str, typer.Option(help="LM repo id.")] = "XiaomiMiMo/MiMo-Audio-7B-Instruct",
    tokenizer: Annotated[str, typer.Option(help="Tokenizer repo id.")] =
        "XiaomiMiMo/MiMo-Audio-Tokenizer",
    debug: Debug = False,
) -> None:
    """Fetch the checkpoints into the Hugging Face cache (needs network access)."""
    reporter = Reporter(debug=debug)

    def body() -> int:
        from mimo_tts import checkpoints

        for ref in checkpoints.download([model, tokenizer]):
            reporter.data(f"{ref.name}\t{ref.path}")
        return EXIT_OK

    run_command(reporter, body)


@app.command()
def selftest(
    lm_device: LmDevice = None, tokenizer_device: TokDevice = None,
    as_json: AsJson = False, debug: Debug = False,
) -> None:
    """A seconds-long end-to-end run on the tiny preset; checks length, finiteness, loudness."""
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts import commands

        report = commands.selftest(lm_device, tokenizer_device, reporter.log)
        reporter.data(report) if as_json else reporter.info(
            f"selftest ok: {report['seconds']:.2f} s of audio, peak {report['peak']:.3f}, "
            f"RTF {report['rtf']:.3f} ({report['path']})")
        return EXIT_OK

    run_command(reporter, body)


SERVE = "Server"


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(rich_help_panel=SERVE,
        help="Address to bind (default 127.0.0.1: this machine only).")] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=SERVE,
                                             help="Port (default 8000).")] = None,
    api_key: Annotated[str | None, typer.Option(rich_help_panel=SERVE, show_default=False,
        help="Require 'Authorization: Bearer KEY' on /v1 (env MIMO_TTS_API_KEY).")] = None,
    voice: Annotated[list[str] | None, typer.Option(rich_help_panel=SERVE,
        help="Register a voice-clone voice: NAME=PROMPT.wav (repeatable).")] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=SERVE,
        help="Requests generated together in one Stage-0 batch (default 8).")] = None,
    max_concurrent: Annotated[int | None, typer.Option(rich_help_panel=SERVE,
        help="Requests in progress at once (default 16).")] = None,
    max_queue: Annotated[int | None, typer.Option(rich_help_panel=SERVE,
        help="Requests waiting beyond those; more get 503 + Retry-After (default 32).")] = None,
    max_input_chars: Annotated[int | None, typer.Option(rich_help_panel=SERVE,
        help="Longest input text (default 4096).")] = None,
    timeout: Annotated[float | None, typer.Option(rich_help_panel=SERVE,
        help="Seconds a request may take (default 300).")] = None,
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN,
        help="Cap on generated groups per text piece (one group = 160 ms).")] = None,
    model: Model = None, tokenizer: Tokenizer = None, lm_device: LmDevice = None,
    tokenizer_device: TokDevice = None, dtype: Dtype = None, tokenizer_dtype: TokDtype = None,
    cuda_graph: Graph = None, no_memory_check: NoMemoryCheck = None,
    lm_threads: LmThreads = None, tokenizer_threads: TokThreads = None, config: Config = None,
    verbose: Verbose = False, debug: Debug = False,
) -> None:
    """Serve an OpenAI-compatible speech API: POST /v1/audio/speech (needs the serve extra)."""
    flags = {k: v for k, v in locals().items() if k not in ("config", "verbose", "debug")}
    reporter = Reporter(verbose=verbose, debug=debug)

    def body() -> int:
        from mimo_tts import serve as server

        return server.main(flags, config, reporter)

    run_command(reporter, body)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
