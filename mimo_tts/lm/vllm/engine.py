"""VLLMEngine: Stage-0 on vLLM behind the `lm.engine.Engine` interface (spec §4.5-4.7; issue 7).

    engine = VLLMEngine(lm_dir, VLLMOptions(max_num_seqs=32))
    for event in engine.run_batch(lm.batching.Jobs(jobs), rows=8):
        ...  # JobGroup / JobDone / IDLE / StepFailed, as the native engine's run_batch
    generations = lm.batching.generate_all(engine, prompts, options)  # whole runs

Each job is its own vLLM request with its own seed: text tokens are sampled by vLLM's sampler
(temperature / top-k / top-p, the request's generator), the codes by the patch decoder in the
worker with the request's own generator; run.py drives the steps (an `<|empty|>` group
arrives one step late).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm.batching import Job
from mimo_tts.lm.config import MAX_GROUPS
from mimo_tts.lm.generate import Collector, GenerationOptions, resolve_stop_ids, split_prompt
from mimo_tts.lm.load import load_config
from mimo_tts.lm.text import TextTokenizer
from mimo_tts.lm.vllm import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_TENSOR_PARALLEL_SIZE,
    VLLM_BOUNDS,
    setting_problem,
)
from mimo_tts.lm.vllm.launch import vllm_options
from mimo_tts.lm.vllm.run import Request, VLLMBatchRun

# Set before vLLM is imported, unless the caller chose otherwise. The V1 model runner is the one
# whose logits-processor hook the row tracker relies on (state.py); vLLM picks V2 on GPUs.
# vLLM logs to stdout by default: stdout is for data (audio, JSON), so its logs go to stderr.
ENV_DEFAULTS = {"VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}
for _name, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)


@dataclass(frozen=True)
class VLLMOptions:
    """Engine options (CLI: --gpu-memory-utilization, --max-num-seqs, --tensor-parallel-size,
    --max-model-len). `kv_cache_memory_bytes` overrides the utilisation (CPU tests: 64 MiB)."""

    dtype: str = "auto"  # checkpoint dtype; float32 / bfloat16 / float16
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # groups, prompt included; default the model's 8192
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tensor_parallel_size: int = DEFAULT_TENSOR_PARALLEL_SIZE
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None  # prefill chunk budget
    block_size: int | None = None  # KV-cache block (groups); vLLM's default when None
    in_process: bool = True  # VLLM_ENABLE_V1_MULTIPROCESSING=0 (tensor parallel still spawns)
    seed: int = 0  # vLLM's engine seed; requests carry their own

    def __post_init__(self):
        for name in VLLM_BOUNDS:
            problem = setting_problem(name, getattr(self, name, None))
            if problem:
                raise UsageError(f"{name} {problem}, got {getattr(self, name)}")


class VLLMEngine:
    """The MiMo-Audio LM served by vLLM (paged attention, continuous batching, tensor
    parallelism), generating like `mimo_tts.lm.generate` (an `lm.engine.Engine`)."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, options: VLLMOptions | None = None):
        self.options = options = options or VLLMOptions()
        self.model_dir = Path(model_dir)
        self.cfg = load_config(self.model_dir)
        self.special = TextTokenizer.from_dir(self.model_dir).special
        # the last run's n-th pulled job -> times its request joined vLLM's batch (> 1: preempted)
        self.last_joins: dict[int, int] = {}
        self._busy = False
        self.llm = _start_llm(self.model_dir, options, self.special.empty)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    # -- public API ---------------------------------------------------------------------------
    def run_batch(self, source, rows: int, guard=None) -> VLLMBatchRun:
        """A continuous batch of up to `rows` requests (at most max_num_seqs) pulling
        `lm.batching.Job`s from `source`, each sampling with its own job's options and seed,
        each step under `guard()` when given; the events of `lm.batching.BatchRun` (run.py).
        One run is iterated at a time: it steps the whole vLLM engine."""
        if rows < 1:
            raise UsageError(f"a batch needs at least one row, got {rows}")
        return VLLMBatchRun(self, source, min(rows, self.options.max_num_seqs), guard)

    def describe(self) -> dict:
        return {"name": self.name}

    def close(self) -> None:
        """Shut the engine down and free its memory (a new engine may start afterwards)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        import gc

        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        gc.collect()
        cleanup_dist_env_and_memory()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests (VLLMBatchRun calls these) ---------------------------------------------------
    def _claim(self) -> None:
        """A run begins: one at a time per engine."""
        if self.llm is None:
            raise UsageError("this VLLMEngine is closed")
        if self._busy:
            raise UsageError("this VLLMEngine is already running a batch; finish or close "
                             "that one first")
        self._busy, self.last_joins = True, {}

    def _add(self, job: Job, slot: int, number: int) -> Request:
        """`job` as a vLLM request with its own options and seed. Refused (InputError,
        UsageError): nothing is added."""
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt

        from mimo_tts.lm.vllm.state import request_args

        options = job.options
        _check_options(options)
        text, codes = split_prompt(self, job.ids.cpu(), self.special.empty)  # [G], [G, F, K]
        prompt_len = text.shape[0]
        if prompt_len >= self.max_model_len:
            raise InputError(f"prompt of {prompt_len} groups leaves no room under "
                             f"max_model_len {self.max_model_len}")
        audio_groups = (text == self.special.empty).nonzero()[:, 0].tolist()
        audio = {p: codes[p].tolist() for p in audio_groups}  # position -> [F][K]
        key, seed = uuid.uuid4().hex, options.seed
        params = self._sampling_params(options, prompt_len, seed,
                                       request_args(key, audio, options.audio_sampler, seed))
        req_id = f"mimo-{key}"  # outputs and aborts use this external id
        rendered = self.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=text.tolist())])
        try:
            self.llm.llm_engine.add_request(req_id, rendered[0], params)
        except (ValueError, VLLMValidationError) as exc:
            raise InputError(f"vLLM refuses the prompt: {exc}") from None
        return Request(job, req_id, number, slot, key, prompt_len, Collector(self.cfg))

    def _sampling_params(self, options: GenerationOptions, prompt_len: int, seed, args):
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        from mimo_tts.lm.vllm.state import EXTRA_KEY

        text = options.text_sampler
        try:
            return SamplingParams(
                temperature=text.temperature, top_k=text.top_k or 0, top_p=text.top_p, seed=seed,
                max_tokens=min(options.max_new_groups, self.max_model_len - prompt_len),
                min_tokens=options.min_new_groups,
                stop_token_ids=resolve_stop_ids(self.special, options.stop_tokens),
                detokenize=False, skip_special_tokens=False, extra_args={EXTRA_KEY: args},
            )
        except (ValueError, VLLMValidationError) as exc:  # e.g. vLLM caps temperature at 2
            raise UsageError(f"vLLM refuses the text sampler {text}: {exc}") from None

    def _abandon(self, requests) -> None:
        """Abort the requests still running in vLLM and drop their worker states."""
        requests = list(requests)
        if self.llm is None or not requests:
            return
        running = [r.req_id for r in requests if not r.finished]
        if running:
            self.llm.llm_engine.abort_request(running)
        keys = [r.key for r in requests if r.key is not None]
        if keys:
            self._rpc("mimo_audio_release", keys)
        for r in requests:
            r.key = None

    def _rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=args)[0]


def _check_options(options: GenerationOptions) -> None:
    if options.text_logits_processor is not None:
        raise UsageError("the vLLM engine samples text in vLLM: text_logits_processor is not "
                         "supported (use the native engine)")
    if options.keep_logits:
        raise UsageError("the vLLM engine does not return step logits (use the native engine)")


def _start_llm(model_dir: Path, options: VLLMOptions, empty_token: int):
    """vLLM's LLM on our architecture, with the row tracker and the worker extension."""
    # Explicit option: in-process, or the engine core in its own process (found by the entry
    # point there). Tensor parallelism spawns its workers either way.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if options.in_process else "1"
    from vllm import LLM

    from mimo_tts.lm.vllm import ARCHITECTURE, register

    register()  # in-process runs need no entry point; spawned processes use it
    extra = {}
    if options.kv_cache_memory_bytes is not None:
        extra["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
    if options.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.block_size is not None:
        extra["block_size"] = options.block_size
    return LLM(
        model=str(model_dir), skip_tokenizer_init=True, dtype=options.dtype,
        hf_overrides={"architectures": [ARCHITECTURE], "mimo_empty_token_id": empty_token},
        # Eager: forward runs Python per request (a captured graph would freeze it). No prefix
        # caching: token ids do not determine an <|empty|> group's KV (its codes do). No async
        # scheduling: the design is verified with forward and sampling in lockstep.
        generation_config="vllm", enforce_eager=True, enable_prefix_caching=False,
        async_scheduling=False,
        logits_processors=["mimo_tts.lm.vllm.state:RequestTracker"],
        worker_extension_cls="mimo_tts.lm.vllm.state.AudioWorkerExtension",
        max_num_seqs=options.max_num_seqs, max_model_len=options.max_model_len or MAX_GROUPS,
        gpu_memory_utilization=options.gpu_memory_utilization,
        # its weight-loading bar is a log line: none when only errors are logged (--quiet)
        use_tqdm_on_load=os.environ.get("VLLM_LOGGING_LEVEL", "").upper() != "ERROR",
        tensor_parallel_size=options.tensor_parallel_size, seed=options.seed, **extra,
    )


def load(lm_dir: Path, placement, options, text) -> VLLMEngine:
    """`lm.engine.EngineSpec.load` for vLLM: the run's settings as `VLLMOptions`."""
    return VLLMEngine(lm_dir, VLLMOptions(**vllm_options(options, placement)))
