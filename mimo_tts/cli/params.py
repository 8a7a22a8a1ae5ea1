"""The options more than one command takes (and the vLLM engine's, beside --engine), as
`Annotated` aliases, and the help's panels.

Each option has a metavar naming what it takes; lists of values come from their one home.
"""

from __future__ import annotations

from typing import Annotated

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
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.options import ENGINES, SynthesisOptions

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

Model = Annotated[str | None, typer.Option(
    "--model", "-m", rich_help_panel=MODELS, metavar="MODEL",
    help="LM checkpoint: a directory, a Hugging Face id (local cache) or 'tiny' (built-in preset). "
         f"Default {DEFAULT_MODEL}.")]
Tokenizer = Annotated[str | None, typer.Option(
    rich_help_panel=MODELS, metavar="TOKENIZER", help="Audio tokenizer: a directory or HF id "
    f"(default {DEFAULT_TOKENIZER}; env {TOKENIZER_PATH_ENV}).")]
LmDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DEVICE",
    help=f"Stage-0 device: cpu, cuda, cuda:N, mps (env {LM_DEVICE_ENV}).")]
TokDevice = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DEVICE",
    help=f"Stage-1 device (env {TOKENIZER_DEVICE_ENV}).")]
Dtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DTYPE", help="LM dtype: auto (default: the checkpoint's, where "
    f"the device runs it natively), {', '.join(DTYPES)} (env {DTYPE_ENV}).")]
TokDtype = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="DTYPE", help="Tokenizer dtype: auto (default), "
    f"{', '.join(DTYPES)} (env {TOKENIZER_DTYPE_ENV}).")]
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
    help=f"CUDA-graph decode on CUDA (env {CUDA_GRAPH_ENV}; never on CPU).")]
EngineName = Annotated[str | None, typer.Option(
    rich_help_panel=VLLM, metavar="ENGINE", help=f"Stage-0 engine: {', '.join(ENGINES)} "
    # `\\[` keeps rich markup from eating the extra's name
    "(default native; vllm needs pip install 'mimo-tts\\[vllm]', without it exit 2). Stage-1 "
    "stays on the tokenizer device.")]
# The vLLM engine's own settings (None: VLLMOptions' defaults, shown from their homes).
GpuMemoryUtilization = Annotated[float | None, typer.Option(
    rich_help_panel=VLLM, metavar="FRACTION", help="vLLM: share of GPU memory for weights + "
    f"KV cache (default {DEFAULT_GPU_MEMORY_UTILIZATION:g}).")]
MaxNumSeqs = Annotated[int | None, typer.Option(
    rich_help_panel=VLLM, metavar="N",
    help=f"vLLM: prompts generated concurrently (default {DEFAULT_MAX_NUM_SEQS}).")]
TensorParallelSize = Annotated[int | None, typer.Option(
    rich_help_panel=VLLM, metavar="N",
    help=f"vLLM: GPUs to shard the LM over (default {DEFAULT_TENSOR_PARALLEL_SIZE}).")]
MaxModelLen = Annotated[int | None, typer.Option(
    rich_help_panel=VLLM, metavar="GROUPS",
    help=f"vLLM: longest sequence in groups, prompt included (default {MAX_GROUPS}).")]
AllowDownload = Annotated[bool | None, typer.Option(
    "--allow-download/--offline", rich_help_panel=MODELS, show_default=False,
    help="Download missing checkpoints (default offline).")]
LmQuant = Annotated[str | None, typer.Option(
    rich_help_panel=DEV, metavar="QUANT",
    help=f"Opt-in weight-only LM quantization on CPU: {', '.join(LM_QUANTS)} (faster, "
         "slightly less exact; default off).")]
# What to say and how to sample it (synth, book).
Instruct = Annotated[str | None, typer.Option(rich_help_panel=IN, metavar="TEXT",
                                              help="Style instruction.")]
PromptAudio = Annotated[str | None, typer.Option(rich_help_panel=IN, metavar="FILE",
                                                 help="Voice prompt audio file.")]
Voice = Annotated[str | None, typer.Option(
    rich_help_panel=IN, metavar="NAME",
    help="A stored voice (mimo-tts voices add): clones it as --prompt-audio its file would.")]
Seed = Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="SEED",
                                          help="Sampling seed (default 0).")]
Temperature = Annotated[float | None, typer.Option(
    rich_help_panel=GEN, metavar="T",
    help=f"Text temperature (0 = greedy; task default {TEXT.temperature:g}).")]
TopK = Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="K", help="Text top-k.")]
TopP = Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="P",
                                            help="Text top-p.")]
AudioTemperature = Annotated[float | None, typer.Option(
    rich_help_panel=GEN, metavar="T",
    help=f"Audio temperature (0 = greedy; task default {AUDIO.temperature:g}).")]
AudioTopK = Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="K",
                                               help="Audio top-k.")]
AudioTopP = Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="P",
                                                 help="Audio top-p.")]
MaxNewGroups = Annotated[int | None, typer.Option(
    rich_help_panel=GEN, metavar="N", help="Cap on generated groups (one group = 160 ms).")]
BatchSize = Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="N",
                                               help="Prompts generated together.")]
Overwrite = Annotated[bool | None, typer.Option(
    "--overwrite", rich_help_panel=OUT, help="Redo items already done and replace existing "
    "files.")]
Shard = Annotated[str | None, typer.Option(
    rich_help_panel=RUN, metavar="K/N",
    help="Run shard K of N (K from 1) of the items, split by id, with its own manifest in the "
         "output folder (default: from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT, or "
         "JOB_COMPLETION_INDEX with MIMO_TTS_SHARD_COUNT).")]
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
Debug = Annotated[bool, typer.Option("--debug", rich_help_panel=RUN,
                                     help="Show tracebacks for errors.")]
