"""Every option of the commands, declared once: the catalogue, and the help's panels.

An `Option` is one flag's whole declaration: its name (the parameter's, and the field's in its
home), the commands that take it, its help (the default, env variable and choices formatted into
it from their homes), metavar, panel, spellings, and its home: `OptionValues` (a run's options,
`OPTIONS`), `ServeConfig` (a server's own, `SERVER`) or the command itself (None). `@takes(name)`
builds a command's Typer signature from it (the `__signature__` pattern of fastapi/typer#154):
a command writes only its own flags, names the catalogue's it uses itself, and has an
`options: OptionValues` (and a server a `serving`) parameter where the rest go.
`add_arguments` gives `scripts/ray_synth.py` the same flags. The flags that say how a command
reports (`--json`, `--quiet`, `--verbose`, `--debug`) are `Annotated` aliases at the end.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Annotated, get_origin, get_type_hints

import typer

from mimo_tts.lm.config import LM_QUANTS, MAX_GROUPS, task_samplers
from mimo_tts.lm.tasks import TASKS
from mimo_tts.lm.vllm import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_TENSOR_PARALLEL_SIZE,
)
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL, DEFAULT_TOKENIZER, TOKENIZER_PATH_ENV
from mimo_tts.runtime.devices import (
    CUDA_GRAPH_ENV,
    DTYPE_ENV,
    DTYPES,
    LM_DEVICE_ENV,
    TOKENIZER_DEVICE_ENV,
    TOKENIZER_DTYPE_ENV,
)
from mimo_tts.server.protocol import API_KEY_ENV, WYOMING_PORT, ServeConfig
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.options import ENGINES, STREAM_MODES, SynthesisOptions
from mimo_tts.synthesis.settings import GROUPS, PROFILE_TYPES, OptionValues, value_type

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
VLLM, SERVE = "vLLM engine", "Server"
# The default task's (text, audio) samplers: the help's "task default" (every TTS task has them)
TEXT, AUDIO = task_samplers(TASKS[SynthesisOptions.task].sampler)
OPTIONS, SERVER = "options", "server"  # an option's home: OptionValues, ServeConfig
HOME_TYPES = {OPTIONS: PROFILE_TYPES,
              SERVER: {k: value_type(t) for k, t in get_type_hints(ServeConfig).items()}}
HOME_DEFAULTS = {OPTIONS: {f.name: f.default for cls in GROUPS.values() for f in fields(cls)},
                 SERVER: {f.name: f.default for f in fields(ServeConfig)}}
_FROM_HOME = object()
# Each server's words for what it takes and its port, as its help says them ({Items}, ...)
FACES = {"serve": {"Items": "Requests", "item": "request", "text": "input text",
                   "busy": "503 + Retry-After", "Port": "Port", "port": ServeConfig.port},
         "wyoming": {"Items": "Texts", "item": "text", "text": "text", "busy": "a busy error",
                     "Port": "TCP port", "port": WYOMING_PORT}}


@dataclass(frozen=True)
class Option:
    """One option, declared once. Its help may name `{default}`, `{env}`, `{choices}` and a
    server's `FACES` words; a flag that takes no value has no metavar."""

    name: str
    commands: tuple[str, ...]  # given space-separated: "synth book voices-add ray_synth"
    help: str
    metavar: str | None = None
    panel: str | None = None
    flags: tuple[str, ...] = ()  # default: --the-name
    home: str | None = OPTIONS
    default: object = _FROM_HOME  # shown; default: the home field's
    env: str | None = None
    choices: tuple[str, ...] = ()
    kind: object = None  # the value's type; default: the home field's

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalised once, when declared
        set_(self, "commands", tuple(self.commands.split()))
        set_(self, "flags", self.flags or (f"--{self.name.replace('_', '-')}",))
        set_(self, "kind", self.kind or HOME_TYPES[self.home][self.name])
        if self.default is _FROM_HOME:
            set_(self, "default", HOME_DEFAULTS.get(self.home, {}).get(self.name))

    def help_for(self, command: str) -> str:
        return self.help.format(default=self.default, env=self.env, choices=", ".join(self.choices),
                           **FACES.get(command, {}))

    def parameter(self, command: str) -> inspect.Parameter:
        """The Typer parameter of `command`: `--flag VALUE`, None when not given."""
        option = typer.Option(*self.flags, help=self.help_for(command), metavar=self.metavar,
                              rich_help_panel=self.panel)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=Annotated[self.kind | None, option])


BATCH = "synth book ray_synth"  # the runs of a batch of items
LOADS = "synth book devices serve wyoming"  # the commands that load (or plan) both stages
CATALOGUE = (
    # the servers' own (ServeConfig), in the servers' help order
    Option("host", "serve wyoming", "Address to bind (default {default}: this machine only).",
           "HOST", SERVE, home=SERVER),
    Option("port", "serve wyoming", "{Port} (default {port}).", "PORT", SERVE, home=SERVER),
    Option("uri", "wyoming", "Where to listen as wyoming-piper writes it, tcp://HOST:PORT (in "
           "place of --host and --port).", "URI", SERVE, home=None, kind=str),
    Option("api_key", "serve", "Require 'Authorization: Bearer KEY' on /v1 and /metrics (env "
           "{env}).", "KEY", SERVE, home=SERVER, env=API_KEY_ENV),
    Option("allowed_hosts", "serve", "Without an API key, answer this Host name too (besides "
           "localhost, 127.0.0.1, [::1] and --host; repeatable): what clients type to reach "
           "the server.", "NAME", SERVE, ("--allowed-host",), SERVER, kind=list[str]),
    Option("voice_files", "serve wyoming", "Register a voice-clone voice: NAME=PROMPT.wav "
           "(repeatable).", "VOICE", SERVE, ("--voice",), SERVER, kind=list[str]),
    Option("batch_size", "serve wyoming", "{Items} generated together in one Stage-0 batch "
           "(default {default}).", "N", SERVE, home=SERVER),
    Option("max_concurrent", "serve wyoming", "{Items} in progress at once (default "
           "{default}).", "N", SERVE, home=SERVER),
    Option("max_queue", "serve wyoming", "{Items} waiting beyond those; more get {busy} (default "
           "{default}).", "N", SERVE, home=SERVER),
    Option("max_input_chars", "serve wyoming", "Longest {text} (default {default}).", "N", SERVE,
           home=SERVER),
    Option("timeout", "serve wyoming", "Seconds a {item} may take (default {default:g}).",
           "SECONDS", SERVE, home=SERVER),
    Option("stage1_batch", "serve", "Streamed requests whose audio is decoded together "
           "(default {default}; 1: one at a time).", "N", SERVE, home=SERVER),
    Option("max_new_groups", "serve wyoming", "Cap on generated groups per text piece (one "
           "group = 160 ms).", "N", GEN),
    # what to say
    Option("task", "synth ray_synth", "Prompt task: {choices} (default {default}).", "TASK", IN,
           choices=tuple(TASKS)),
    Option("instruct", BATCH, "Style instruction.", "TEXT", IN),
    Option("prompt_audio", BATCH, "Voice prompt audio file.", "FILE", IN),
    Option("voice", BATCH, "A stored voice (mimo-tts voices add): clones it as --prompt-audio "
           "its file would.", "NAME", IN),
    Option("voice_per_piece", "book", "Read each piece in the model's own voice, which may "
           "change from piece to piece (default without --voice or --prompt-audio: the book's "
           "first piece, read once, is the voice of every piece: book-voice.wav).", panel=IN,
           home=None, kind=bool),
    Option("caption_formats", "synth", "Write captions beside each output: srt, vtt or srt,vtt. "
           "Each sentence is then synthesised as its own piece, so the audio differs from a run "
           "without.", "FORMATS", OUT, ("--captions",)),
    Option("template", "synth", "Fix the instruction template index (default: drawn from the "
           "seed).", "N", IN),
    Option("max_chars", "synth", "Split longer text on sentence ends (default {default}; 0 = "
           "never).", "N", IN),
    # the checkpoints and where they run
    Option("model", f"{LOADS} voices-add ray_synth", "LM checkpoint: a directory, a Hugging Face "
           "id (local cache) or 'tiny' (built-in preset). Default {default}.", "MODEL", MODELS,
           ("--model", "-m"), default=DEFAULT_MODEL),
    Option("tokenizer", f"{LOADS} decode voices-add ray_synth", "Audio tokenizer: a directory "
           "or HF id (default {default}; env {env}).", "TOKENIZER", MODELS,
           default=DEFAULT_TOKENIZER, env=TOKENIZER_PATH_ENV),
    Option("allow_download", "synth book", "Download missing checkpoints (default offline).",
           panel=MODELS, flags=("--allow-download/--offline",)),
    Option("lm_device", f"{LOADS} selftest ray_synth", "Stage-0 device: cpu, cuda, cuda:N, mps "
           "(env {env}).", "DEVICE", DEV, env=LM_DEVICE_ENV),
    Option("tokenizer_device", f"{LOADS} decode selftest voices-add ray_synth", "Stage-1 device "
           "(env {env}).", "DEVICE", DEV, env=TOKENIZER_DEVICE_ENV),
    Option("dtype", f"{LOADS} ray_synth", "LM dtype: auto (default: the checkpoint's, where the "
           "device runs it natively), {choices} (env {env}).", "DTYPE", DEV, env=DTYPE_ENV,
           choices=DTYPES),
    Option("tokenizer_dtype", f"{LOADS} decode voices-add ray_synth", "Tokenizer dtype: auto "
           "(default), {choices} (env {env}).", "DTYPE", DEV, env=TOKENIZER_DTYPE_ENV,
           choices=DTYPES),
    Option("cuda_graph", f"{LOADS} decode", "CUDA-graph decode on CUDA (env {env}; never on "
           "CPU).", panel=DEV, flags=("--cuda-graph/--no-cuda-graph",), env=CUDA_GRAPH_ENV),
    Option("no_memory_check", f"{LOADS} decode", "Load even when the memory preflight says the "
           "run does not fit (exit 4 otherwise).", panel=DEV),
    Option("lm_quant", "synth book serve wyoming", "Opt-in LM quantization on CPU: {choices} "
           "(int8: weight-only; w8a8: int8 weights by int8 activations, bfloat16 models; w4a8: "
           "4-bit weights in groups of 32 by int8 activations, bfloat16 models, the fastest "
           "and least exact; all less exact than the default, off).", "QUANT", DEV,
           choices=LM_QUANTS),
    Option("lm_threads", "synth book serve wyoming", "CPU threads for Stage-0 (default: torch's; "
           "--stream on one CPU splits the cores between the stages).", "N", DEV),
    Option("tokenizer_threads", "synth book serve wyoming", "CPU threads for Stage-1 decode and "
           "prompt encode.", "N", DEV),
    # how to sample
    Option("seed", BATCH, "Sampling seed (default {default}).", "SEED", GEN),
    Option("speed", "synth book serve wyoming", "Speaking rate, pitch kept: 0.25 to 4 (default "
           "{default:g}; 1.5 is half again as fast). The audio is stretched after Stage-1, so "
           "the codes are speed 1's.", "RATE", GEN),
    Option("sentence_silence", "synth book serve wyoming", "Seconds of silence between "
           "sentences (default {default:g}); \\[pause:1.5] or SSML <break time=\"500ms\"/> in the "
           "text ask their own.", "SECONDS", GEN),
    Option("temperature", "synth book", "Text temperature (0 = greedy; task default "
           "{default:g}).", "T", GEN, default=TEXT.temperature),
    Option("top_k", "synth book", "Text top-k.", "K", GEN),
    Option("top_p", "synth book", "Text top-p.", "P", GEN),
    Option("audio_temperature", "synth book", "Audio temperature (0 = greedy; task default "
           "{default:g}).", "T", GEN, default=AUDIO.temperature),
    Option("audio_top_k", "synth book", "Audio top-k.", "K", GEN),
    Option("audio_top_p", "synth book", "Audio top-p.", "P", GEN),
    Option("max_new_groups", BATCH, "Cap on generated groups (one group = 160 ms).", "N", GEN),
    Option("batch_size", BATCH, "Prompts generated together.", "N", GEN),
    # where the audio goes
    Option("output_dir", "synth ray_synth", "Root of <dir>/<task>/<id>.wav (default {default}).",
           "DIR", OUT),
    Option("output_dir", "book", "The book's folder: pieces, chapters/, book.m4b, book.srt, "
           "book.vtt, book.json (default {default}/<the book's name>).", "DIR", OUT),
    Option("output", "synth", "One item: write to this file, or '-' for stdout.", "FILE", OUT,
           ("--output", "-o")),
    Option("format", "synth decode ray_synth", "Audio format: {choices} (default {default}: "
           "PCM16); with -o FILE the extension names it.", "FORMAT", OUT, choices=tuple(FORMATS)),
    Option("sample_rate", "synth decode", "Resample the output to this rate (default "
           "{default}).", "HZ", OUT),
    Option("save_codes", "synth ray_synth", "Also write the Stage-0 codes "
           "(<id>.codes.safetensors).", panel=OUT),
    Option("overwrite", BATCH, "Redo items already done and replace existing files.",
           panel=OUT),
    Option("stream", "synth", "Decode audio while the LM generates (streaming Stage-1).",
           panel=OUT),
    Option("raw", "synth", "Stream 16-bit 24 kHz mono PCM to stdout as it is decoded.",
           panel=OUT),
    Option("stream_mode", "synth", "Streaming decoder ({choices}): incremental (default) decodes "
           "each frame once, closest to one-shot; official re-decodes overlapping windows (spec "
           "§7.2).", "MODE", OUT, choices=STREAM_MODES),
    # the Stage-0 engine and the vLLM engine's own settings
    Option("engine", "synth book devices ray_synth", "Stage-0 engine: {choices} (default "
           # `\\[` keeps rich markup from eating the extra's name
           "{default}; vllm needs pip install 'mimo-tts\\[vllm]', without it exit 2). Stage-1 "
           "stays on the tokenizer device.", "ENGINE", VLLM, choices=ENGINES),
    Option("gpu_memory_utilization", "synth book", "vLLM: share of GPU memory for weights + KV "
           "cache (default {default:g}).", "FRACTION", VLLM,
           default=DEFAULT_GPU_MEMORY_UTILIZATION),
    Option("max_num_seqs", "synth book", "vLLM: prompts generated concurrently (default "
           "{default}).", "N", VLLM, default=DEFAULT_MAX_NUM_SEQS),
    Option("tensor_parallel_size", "synth book", "vLLM: GPUs to shard the LM over (default "
           "{default}).", "N", VLLM, default=DEFAULT_TENSOR_PARALLEL_SIZE),
    Option("max_model_len", "synth book", "vLLM: longest sequence in groups, prompt included "
           "(default {default}).", "GROUPS", VLLM, default=MAX_GROUPS),
    # the run itself (the commands take these by name)
    Option("config", f"{LOADS} ray_synth", "TOML profile: a path, or a name in ~/.config/mimo-tts "
           "(MIMO_TTS_CONFIG_DIR) or the built-in default, cpu-tokenizer, ci-smoke.", "PROFILE",
           RUN, ("--config", "-c"), None, kind=str),
    Option("shard", "synth book", "Run shard K of N (K from 1) of the items, split by id, with "
           "its own manifest in the output folder (default: from SLURM_ARRAY_TASK_ID/"
           "SLURM_ARRAY_TASK_COUNT, or JOB_COMPLETION_INDEX with MIMO_TTS_SHARD_COUNT).", "K/N",
           RUN, home=None, kind=str),
)


def options_of(command: str) -> list[Option]:
    """The catalogue's options that `command` takes, in the catalogue's order."""
    return [option for option in CATALOGUE if command in option.commands]


def takes(command: str):
    """Give a command its Typer signature: its own parameters as written, each catalogue option
    of `command` it names in that place, and the rest where its `options` parameter stands.
    Called, it gets their `OptionValues` as `options`, the server's own given ones by name as
    `serving`, and each option it names as that parameter."""
    mine = {option.name: option for option in options_of(command)}

    def build(fn):
        own = inspect.signature(fn, eval_str=True).parameters
        rest = [option for name, option in mine.items() if name not in own]
        params = []
        for p in own.values():
            if p.name in mine and get_origin(p.annotation) is Annotated:
                raise TypeError(f"{command}: --{p.name} is the catalogue's; declare it there")
            if p.name == "options":
                params += [option.parameter(command) for option in rest]
            elif p.name != "serving":
                params.append(mine[p.name].parameter(command) if p.name in mine
                              else p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        for option in rest:
            if {OPTIONS: "options", SERVER: "serving"}.get(option.home) not in own:
                raise TypeError(f"{command}: nowhere takes --{option.name}")

        def run(**values):
            given = [(option, values.pop(option.name)) for option in rest]
            if "options" in own:
                values["options"] = OptionValues(**{o.name: v for o, v in given
                                                    if o.home == OPTIONS})
            if "serving" in own:
                values["serving"] = {o.name: v for o, v in given
                                     if o.home == SERVER and v is not None}
            return fn(**values)

        run.__name__, run.__qualname__, run.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        run.__module__, run.__signature__ = fn.__module__, inspect.Signature(params)
        run.__wrapped__ = fn  # (inspect and Typer read __signature__ first)
        return run

    return build


def add_arguments(parser, command: str) -> None:
    """The catalogue's options of `command` on an argparse parser: the same flags, metavars
    and help (without rich markup); a value not given stays None."""
    for option in options_of(command):
        text = option.help_for(command).replace("\\[", "[").replace("%", "%%")
        if option.kind is not bool:
            parser.add_argument(*option.flags, type=option.kind, metavar=option.metavar,
                                help=text)
            continue
        on, _, off = option.flags[0].partition("/")
        parser.add_argument(on, *option.flags[1:], dest=option.name, action="store_true",
                            default=None, help=text)
        if off:
            parser.add_argument(off, dest=option.name, action="store_false", default=None)


# How a command reports: each command takes these as its own.
Quiet = Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=RUN,
                                     help="Only errors on stderr (data still on stdout).")]
ServeQuiet = Annotated[bool, typer.Option(
    "--quiet", "-q", rich_help_panel=RUN, help="Only errors on stderr: no request log (one line "
    "per request otherwise), no start-up lines.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", rich_help_panel=RUN,
                                       help="More detail on stderr (loading, placement).")]
AsJson = Annotated[bool, typer.Option("--json", rich_help_panel=RUN,
                                      help="One JSON object per item on stdout.")]
# Each other command's --json, in its own words.
DevicesJson = Annotated[bool, typer.Option(
    "--json", rich_help_panel=RUN, help="The preflight report as one JSON object on one line of "
    "stdout (default: a short table on a terminal, indented JSON otherwise).")]
StatusJson = Annotated[bool, typer.Option(
    "--json", help="The report as one JSON object on stdout: counts, each failed and missing "
    "item, per shard (default: lines of text).")]
SelftestJson = Annotated[bool, typer.Option(
    "--json", help="The result as one JSON object on stdout: seconds, frames, peak, RTF "
    "(default: one line on stderr).")]
VoiceAddJson = Annotated[bool, typer.Option(
    "--json", rich_help_panel=RUN, help="The stored voice's record as one JSON object on stdout "
    "(default: the record's path).")]
VoicesListJson = Annotated[bool, typer.Option(
    "--json", help="One JSON object per stored voice on stdout (default: a line each).")]
Debug = Annotated[bool, typer.Option("--debug", rich_help_panel=RUN,
                                     help="Show tracebacks for errors.")]
