"""`mimo-tts`: the command line (Typer + rich). Thin: parse -> options -> batch runner -> report.

Data goes to stdout (written paths, `--json` lines, audio with `-o -`/`--raw`); logs, progress
and errors go to stderr. torch is never imported here: the command bodies (`commands.py`) are
imported inside the commands, and `--help`, `devices` and `synth --dry-run` never import it.
Errors are one `Error:` line with a documented exit code (README "Exit codes", and
docs/reliability.md); `--debug` adds the traceback. SIGINT, SIGTERM and SIGHUP stop a run
after cleaning up (exit 130): finished items are kept and a re-run resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand, TyperGroup

from mimo_tts import __version__
from mimo_tts.batch.files import _broken_pipe, write_stdout_line
from mimo_tts.errors import (
    EXIT_BUG,
    EXIT_CHECKPOINT,
    EXIT_DEVICE,
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_OK,
    EXIT_USAGE,
    MimoTTSError,
)
from mimo_tts.lm.config import LM_QUANTS
from mimo_tts.lm.tasks import TASKS
from mimo_tts.runtime.devices import DTYPES
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.options import ENGINES, STREAM_MODES

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


def _plain_metavars(params: list) -> list:
    """A flag takes no value: no `<bool>` beside it (`--help` included); an argument shows its
    metavar alone, without `<list[str]>` (Typer's options already do)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar:
            param.display_type_rich = lambda ctx: None
    return params


class Command(TyperCommand):
    """Every mimo-tts command: plain metavars in the help and the usage line."""

    def get_params(self, ctx):
        return _plain_metavars(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        # Typer writes a required argument as `{CODES}...`; the usual form is `CODES...`
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


class App(TyperGroup):
    """The mimo-tts group: plain metavars in the help; parse errors as one line off a terminal."""

    def get_params(self, ctx):
        return _plain_metavars(super().get_params(ctx))

    def make_context(self, *args, **kwargs):
        with _parse_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):  # a command's own parse runs in here
        with _parse_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _parse_errors():
    """Typer's usage errors (exit 2) as one `Error:` line naming the help command when stderr
    is not a terminal, so a CI log's last line says what went wrong; a terminal gets the box.
    Help or version text into a closed pipe is exit 5, as any data (Typer and rich exit 1).

    Typer keeps its Click exceptions private: a usage error is known by exit code 2 and
    `format_message`, and a bare `mimo-tts` (help, then exit 2) is left to Typer."""
    try:
        yield
    except (BrokenPipeError, SystemExit) as exc:
        # rich's Console answers a broken pipe with SystemExit(1), raised while handling it
        if not isinstance(exc, BrokenPipeError) and not isinstance(exc.__context__,
                                                                   BrokenPipeError):
            raise
        Reporter().error(str(_broken_pipe()))
        raise typer.Exit(EXIT_IO) from None
    except Exception as exc:
        if (getattr(exc, "exit_code", None) != EXIT_USAGE or not hasattr(exc, "format_message")
                or type(exc).__name__ == "NoArgsIsHelpError"):
            raise
        reporter = Reporter()
        if reporter.err.is_terminal:
            raise
        ctx = getattr(exc, "ctx", None)
        message = " ".join(exc.format_message().split())
        reporter.error(message.rstrip(".") + (f"; see {ctx.command_path} --help" if ctx else ""))
        raise typer.Exit(EXIT_USAGE) from None


app = typer.Typer(
    name="mimo-tts", no_args_is_help=True, rich_markup_mode="rich", epilog=EXAMPLES,
    pretty_exceptions_enable=False, cls=App,
    context_settings={"help_option_names": ["--help", "-h"]},  # inherited by every command
    help="Offline text-to-speech with Xiaomi MiMo-Audio: Stage-0 LM -> codes, Stage-1 -> wav.",
)

# --- shared option types ------------------------------------------------------------------------
# Each option has a metavar naming what it takes; lists of values come from their one home.
Model = Annotated[str | None, typer.Option(
    "--model", "-m", rich_help_panel=MODELS, metavar="MODEL",
    help="LM checkpoint: a directory, a Hugging Face id (local cache) or 'tiny' (built-in preset). "
         "Default XiaomiMiMo/MiMo-Audio-7B-Instruct.")]
Tokenizer = Annotated[str | None, typer.Option(
    rich_help_panel=MODELS, metavar="TOKENIZER", help="Audio tokenizer: a directory or HF id "
    "(default XiaomiMiMo/MiMo-Audio-Tokenizer; env MIMO_AUDIO_TOKENIZER_PATH).")]
LmDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DEVICE",
    help="Stage-0 device: cpu, cuda, cuda:N, mps (env MIMO_TTS_LM_DEVICE).")]
TokDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DEVICE",
    help="Stage-1 device (env MIMO_AUDIO_TOKENIZER_DEVICE).")]
Dtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DTYPE", help="LM dtype: auto (default: the checkpoint's, where "
    f"the device runs it natively), {', '.join(DTYPES)} (env MIMO_TTS_DTYPE).")]
TokDtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DTYPE", help="Tokenizer dtype: auto (default), "
    f"{', '.join(DTYPES)} (env MIMO_TTS_TOKENIZER_DTYPE).")]
NoMemoryCheck = Annotated[bool | None, typer.Option(
    "--no-memory-check", rich_help_panel=DEV, show_default=False,
    help="Load even when the memory preflight says the run does not fit (exit 4 otherwise).")]
LmThreads = Annotated[int | None, typer.Option(
    rich_help_panel=DEV, metavar="N", help="CPU threads for Stage-0 (default: torch's; --stream "
    "on one CPU splits the cores between the stages).")]
TokThreads = Annotated[int | None, typer.Option(
    rich_help_panel=DEV, metavar="N", help="CPU threads for Stage-1 decode and prompt encode.")]
Graph = Annotated[bool | None, typer.Option(
    "--cuda-graph/--no-cuda-graph", rich_help_panel=DEV, show_default=False,
    help="CUDA-graph decode on CUDA (env MIMO_AUDIO_TOKENIZER_CUDA_GRAPH; never on CPU).")]
EngineName = Annotated[str | None, typer.Option(
    rich_help_panel=VLLM, metavar="ENGINE", help=f"Stage-0 engine: {', '.join(ENGINES)} "
    # `\\[` keeps rich markup from eating the extra's name
    "(default native; vllm needs pip install 'mimo-tts\\[vllm]', without it exit 2). Stage-1 "
    "stays on the tokenizer device.")]
Config = Annotated[str | None, typer.Option(
    "--config", "-c", rich_help_panel=RUN, metavar="PROFILE",
    help="TOML profile: a path, or a name in ~/.config/mimo-tts (MIMO_TTS_CONFIG_DIR) or the "
         "built-in default, cpu-tokenizer, ci-smoke.")]
Fmt = Annotated[str | None, typer.Option(
    "--format", rich_help_panel=OUT, metavar="FORMAT",
    help=f"Audio format: {', '.join(FORMATS)} (default wav: PCM16); with -o FILE the extension "
    "names it.")]
Rate = Annotated[int | None, typer.Option(
    rich_help_panel=OUT, metavar="HZ", help="Resample the output to this rate (default 24000).")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=RUN,
                                     help="Only errors on stderr (data still on stdout).")]
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
        self.stdout_text = stdout_data  # stdout takes text (not audio bytes: -o -, --raw)
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

    @contextlib.contextmanager
    def bar(self, total: int):
        """A progress bar on stderr, only on a terminal and never with --quiet/--json."""
        if self.quiet or self.as_json or not self.err.is_terminal or total < 2:
            yield lambda: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        # Data lines stay on stdout: rich may only route them above the bar when stdout is
        # the very terminal the bar is drawn on.
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=self.err,
                      transient=True, redirect_stdout=_same_terminal(),
                      redirect_stderr=False) as progress:
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
        elif result.path is not None and self.stdout_data:
            self.data(str(result.path))


def _same_terminal() -> bool:
    """Whether stdout and stderr are one terminal (device and inode)."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no real fds (e.g. captured streams)
        return False
    return os.isatty(sys.stdout.fileno()) and os.path.samestat(out, err)


def run_command(reporter: Reporter, body) -> None:
    """Run a command body, mapping typed errors and interrupts to one line and an exit code."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupt)
    try:
        code = body()
    except MimoTTSError as exc:
        if reporter.debug:
            reporter.err.print_exception()
        code = _run_error(reporter, str(exc), exc.exit_code)
    except KeyboardInterrupt:
        code = _run_error(reporter, "interrupted; finished items are kept: re-run the same "
                          "command to resume", EXIT_INTERRUPTED)
    except Exception as exc:  # a bug: say so, with the trace under --debug
        if reporter.debug:
            reporter.err.print_exception()
        code = _run_error(reporter, f"unexpected {type(exc).__name__}: {exc} (re-run with "
                          "--debug)", EXIT_BUG)
    raise typer.Exit(code or EXIT_OK)


def _run_error(reporter: Reporter, message: str, code: int) -> int:
    """A run-level error: the `Error:` line, and under --json one JSON object on stdout."""
    reporter.error(message)
    if reporter.as_json and reporter.stdout_text:
        with contextlib.suppress(MimoTTSError):  # stdout itself may be what failed
            reporter.data({"status": "error", "error": message, "exit_code": code})
    return code


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


@app.command(cls=Command, epilog=EXAMPLES)
def synth(
    text: Annotated[list[str] | None, typer.Option(
        "--text", "-t", rich_help_panel=IN, metavar="TEXT",
        help="Text to speak (repeatable; '-' reads stdin).")] = None,
    input: Annotated[list[str] | None, typer.Option(
        "--input", "-i", rich_help_panel=IN, metavar="FILE",
        help=".txt (one item per line) or .jsonl (id, text, instruct, prompt_audio, seed); "
             "'-' reads stdin.")] = None,
    task: Annotated[str | None, typer.Option(rich_help_panel=IN, metavar="TASK",
        help=f"Prompt task: {', '.join(TASKS)} (default tts_sft).")] = None,
    instruct: Annotated[str | None, typer.Option(rich_help_panel=IN, metavar="TEXT",
                                                 help="Style instruction.")] = None,
    prompt_audio: Annotated[str | None, typer.Option(rich_help_panel=IN, metavar="FILE",
                                                     help="Voice prompt audio file.")] = None,
    template: Annotated[int | None, typer.Option(rich_help_panel=IN, metavar="N",
        help="Fix the instruction template index (default: drawn from the seed).")] = None,
    max_chars: Annotated[int | None, typer.Option(rich_help_panel=IN, metavar="N",
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
    lm_quant: Annotated[str | None, typer.Option(rich_help_panel=DEV, metavar="QUANT",
        help=f"Opt-in weight-only LM quantization on CPU: {', '.join(LM_QUANTS)} (faster, "
             "slightly less exact; default off).")] = None,
    lm_threads: LmThreads = None,
    tokenizer_threads: TokThreads = None,
    seed: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="SEED",
                                             help="Sampling seed (default 0).")] = None,
    temperature: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="T",
        help="Text temperature (0 = greedy; task default 0.6).")] = None,
    top_k: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="K",
                                              help="Text top-k.")] = None,
    top_p: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="P",
                                                help="Text top-p.")] = None,
    audio_temperature: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="T",
        help="Audio temperature (0 = greedy; task default 0.9).")] = None,
    audio_top_k: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="K",
                                                    help="Audio top-k.")] = None,
    audio_top_p: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="P",
                                                      help="Audio top-p.")] = None,
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
        help="Cap on generated groups (one group = 160 ms).")] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
        help="Prompts generated together.")] = None,
    output_dir: Annotated[str | None, typer.Option(rich_help_panel=OUT, metavar="DIR",
        help="Root of <dir>/<task>/<id>.wav (default output_audio).")] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", rich_help_panel=OUT,
        metavar="FILE", help="One item: write to this file, or '-' for stdout.")] = None,
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
    stream_mode: Annotated[str | None, typer.Option(rich_help_panel=OUT, metavar="MODE",
        help=f"Streaming decoder ({', '.join(STREAM_MODES)}): incremental (default) decodes "
             "each frame once, closest to one-shot; official re-decodes overlapping windows "
             "(spec §7.2).")] = None,
    engine: EngineName = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(rich_help_panel=VLLM,
        metavar="FRACTION",
        help="vLLM: share of GPU memory for weights + KV cache (default 0.9).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="N",
        help="vLLM: prompts generated concurrently (default 32).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="N",
        help="vLLM: GPUs to shard the LM over (default 1).")] = None,
    max_model_len: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="GROUPS",
        help="vLLM: longest sequence in groups, prompt included (default 8192).")] = None,
    config: Config = None,
    shard: Annotated[str | None, typer.Option(rich_help_panel=RUN, metavar="K/N",
        help="Run shard K of N (K from 1) of the items, split by id, with its own manifest "
             "in the output folder (default: from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT, "
             "or JOB_COMPLETION_INDEX with MIMO_TTS_SHARD_COUNT).")] = None,
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
        if quiet:
            _quiet_libraries()
        from mimo_tts.batch import plan as commands
        from mimo_tts.batch.results import exit_code_for

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


def _quiet_libraries() -> None:
    """--quiet: what the libraries print on stderr is cut to errors too (vLLM's logs and its
    loading bar, torch's C++ and Python warnings), set before they are imported; a variable
    the user set stays."""
    import warnings

    for name, value in (("VLLM_LOGGING_LEVEL", "ERROR"), ("TORCH_CPP_LOG_LEVEL", "ERROR"),
                        ("TORCH_LOGS", "-torch"), ("TQDM_DISABLE", "1")):
        os.environ.setdefault(name, value)
    warnings.simplefilter("ignore")


def _preflight(reporter: Reporter, flags: dict, config: str | None) -> int:
    from mimo_tts.batch import plan as commands

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


@app.command(cls=Command)
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


@app.command(cls=Command)
def status(
    output_dir: Annotated[str, typer.Argument(
        metavar="OUTPUT_DIR",
        help="The output folder (--output-dir of synth), or its <task> folder.")],
    input: Annotated[list[str] | None, typer.Option(
        "--input", "-i", metavar="FILE", help="The run's input file(s): items without a result "
                                              "count as missing.")] = None,
    task: Annotated[str, typer.Option(
        metavar="TASK", help="The task folder under OUTPUT_DIR.")] = "tts_sft",
    merge: Annotated[bool, typer.Option(
        "--merge", help="Write every shard's lines into one results.jsonl.")] = False,
    as_json: AsJson = False, debug: Debug = False,
) -> None:
    """Done / failed / missing items across all shards' manifests of an output folder.

    Exits 0 when every item is done, 10 when some are failed or missing.
    """
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts.batch import status as folder_status

        report = folder_status.report(output_dir, task, input or [], merge)
        if as_json:
            reporter.data(report)
        else:
            for line in folder_status.lines(report):
                reporter.data(line)
        return folder_status.exit_code(report)

    run_command(reporter, body)


@app.command(cls=Command)
def decode(
    codes: Annotated[list[str], typer.Argument(
        metavar="CODES", help="Codes file(s) written by --save-codes.")],
    tokenizer: Tokenizer = None, tokenizer_device: TokDevice = None,
    tokenizer_dtype: TokDtype = None, cuda_graph: Graph = None,
    output: Annotated[str | None, typer.Option("--output", "-o", rich_help_panel=OUT,
        metavar="FILE",
        help="Output file ('-' = stdout); default <codes stem>.decoded.wav beside the codes.")
    ] = None,
    format: Fmt = None, sample_rate: Rate = None,
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
        from mimo_tts.batch import plan as commands
        from mimo_tts.batch.results import exit_code_for

        results = []
        for result in commands.decode_files(
                codes, reporter.log, output=output, fmt=format, sample_rate=sample_rate,
                tokenizer=tokenizer, tokenizer_device=tokenizer_device,
                tokenizer_dtype=tokenizer_dtype, cuda_graph=cuda_graph, overwrite=overwrite):
            results.append(result)
            if result.error is not None:
                reporter.err.print(f"failed {result.source}: {result.error}", markup=False)
            elif result.path is not None and reporter.stdout_data:
                reporter.data(str(result.path))
        return exit_code_for(results)

    run_command(reporter, body)


@app.command(cls=Command)
def download(
    model: Annotated[str, typer.Option(metavar="REPO", help="LM repo id.")] =
        "XiaomiMiMo/MiMo-Audio-7B-Instruct",
    tokenizer: Annotated[str, typer.Option(metavar="REPO", help="Tokenizer repo id.")] =
        "XiaomiMiMo/MiMo-Audio-Tokenizer",
    debug: Debug = False,
) -> None:
    """Fetch the checkpoints into the Hugging Face cache (needs network access)."""
    reporter = Reporter(debug=debug)

    def body() -> int:
        from mimo_tts.runtime import checkpoints

        for ref in checkpoints.download([model, tokenizer]):
            reporter.data(f"{ref.name}\t{ref.path}")
        return EXIT_OK

    run_command(reporter, body)


@app.command(cls=Command)
def selftest(
    lm_device: LmDevice = None, tokenizer_device: TokDevice = None,
    as_json: AsJson = False, debug: Debug = False,
) -> None:
    """A seconds-long end-to-end run on the tiny preset; checks length, finiteness, loudness."""
    reporter = Reporter(as_json=as_json, debug=debug)

    def body() -> int:
        from mimo_tts.batch import plan as commands

        report = commands.selftest(lm_device, tokenizer_device, reporter.log)
        reporter.data(report) if as_json else reporter.info(
            f"selftest ok: {report['seconds']:.2f} s of audio, peak {report['peak']:.3f}, "
            f"RTF {report['rtf']:.3f} ({report['path']})")
        return EXIT_OK

    run_command(reporter, body)


SERVE = "Server"


@app.command(cls=Command)
def serve(
    host: Annotated[str | None, typer.Option(rich_help_panel=SERVE, metavar="HOST",
        help="Address to bind (default 127.0.0.1: this machine only).")] = None,
    port: Annotated[int | None, typer.Option(rich_help_panel=SERVE, metavar="PORT",
                                             help="Port (default 8000).")] = None,
    api_key: Annotated[str | None, typer.Option(rich_help_panel=SERVE, metavar="KEY",
                                                show_default=False,
        help="Require 'Authorization: Bearer KEY' on /v1 (env MIMO_TTS_API_KEY).")] = None,
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
    max_new_groups: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
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
        from mimo_tts.server import app as server

        return server.main(flags, config, reporter)

    run_command(reporter, body)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
