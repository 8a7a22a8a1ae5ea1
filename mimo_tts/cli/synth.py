"""`mimo-tts synth` and `mimo-tts devices`: a run, or its preflight (devices, checkpoints,
memory, shard) without loading anything.

The batch code (`batch/plan.py`, the runner) is imported inside the commands: `--help`,
`devices` and `synth --dry-run` never import torch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Annotated

import typer
from rich.console import Console

from mimo_tts.cli.params import (
    DEV,
    GEN,
    IN,
    MODELS,
    OUT,
    RUN,
    VLLM,
    AsJson,
    Config,
    Debug,
    Dtype,
    EngineName,
    Fmt,
    Graph,
    LmDevice,
    LmThreads,
    Model,
    NoMemoryCheck,
    Quiet,
    Rate,
    TokDevice,
    TokDtype,
    Tokenizer,
    TokThreads,
    Verbose,
)
from mimo_tts.cli.report import Reporter, run_command
from mimo_tts.codec.config import STREAM_MODES
from mimo_tts.errors import EXIT_CHECKPOINT, EXIT_DEVICE, EXIT_OK
from mimo_tts.lm.config import LM_QUANTS, MAX_GROUPS, task_samplers
from mimo_tts.lm.tasks import TASKS
from mimo_tts.lm.vllm import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_TENSOR_PARALLEL_SIZE,
)
from mimo_tts.synthesis.options import SynthesisOptions

# The default task's (text, audio) samplers: the help's "task default" (every TTS task has them)
TEXT, AUDIO = task_samplers(TASKS[SynthesisOptions.task].sampler)


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
        help=f"Text temperature (0 = greedy; task default {TEXT.temperature:g}).")] = None,
    top_k: Annotated[int | None, typer.Option(rich_help_panel=GEN, metavar="K",
                                              help="Text top-k.")] = None,
    top_p: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="P",
                                                help="Text top-p.")] = None,
    audio_temperature: Annotated[float | None, typer.Option(rich_help_panel=GEN, metavar="T",
        help=f"Audio temperature (0 = greedy; task default {AUDIO.temperature:g}).")] = None,
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
        help="vLLM: share of GPU memory for weights + KV cache (default "
             f"{DEFAULT_GPU_MEMORY_UTILIZATION:g}).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="N",
        help=f"vLLM: prompts generated concurrently (default {DEFAULT_MAX_NUM_SEQS}).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="N",
        help=f"vLLM: GPUs to shard the LM over (default {DEFAULT_TENSOR_PARALLEL_SIZE}).")] = None,
    max_model_len: Annotated[int | None, typer.Option(rich_help_panel=VLLM, metavar="GROUPS",
        help=f"vLLM: longest sequence in groups, prompt included (default {MAX_GROUPS}).")
    ] = None,
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
        from mimo_tts.batch.plan import prepare_synth, run_synth
        from mimo_tts.batch.results import exit_code_for
        from mimo_tts.batch.runner import BatchRunner

        plan = prepare_synth(flags, config, sys.stdin, reporter.log)
        runner = BatchRunner(plan.settings, log=reporter.log)
        start = time.perf_counter()
        with runner, reporter.bar(len(plan.items)) as advance:  # closes the engine (vLLM)
            results = []
            for result in run_synth(runner, plan.items, plan.sink()):
                results.append(result)
                reporter.item(result, plan.settings.synthesis.task)
                advance()
        reporter.info(summary(results, runner, time.perf_counter() - start))
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
    report = preflight_report(flags, config)
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



def preflight_report(flags: Mapping[str, object], config: str | None) -> dict:
    """The preflight of the run these flags describe: the `--input` files are read and checked
    as a run reads them (stdin is left alone), and their texts with `--text` size the memory
    plan."""
    from mimo_tts.batch.items import read_items
    from mimo_tts.batch.plan import settings_for, shard_for
    from mimo_tts.synthesis.preflight import preflight

    texts = [t for t in flags.get("text") or [] if t != "-"]
    files = [f for f in flags.get("input") or [] if f != "-"]
    settings = settings_for(flags, config)
    items = read_items([], files) if files else []
    shard = shard_for(settings, flags.get("shard"))
    report = preflight(settings, texts + [i.text for i in items if isinstance(i.text, str)])
    report["shard"] = (shard.describe() if shard else
                       {"shard": None, "source": "default: every item"})
    if files:
        report["inputs"] = {"files": files, "items": len(items),
                            "bad_items": sum(i.error is not None for i in items)}
    return report


def summary(results: list, runner, elapsed: float) -> str:
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
