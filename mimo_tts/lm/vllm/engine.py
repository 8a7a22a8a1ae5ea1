"""VLLMEngine: Stage-0 on vLLM with the native engine's API (spec §4.5-4.7; issue 7).

    engine = VLLMEngine(lm_dir, VLLMOptions(max_num_seqs=32))
    for step in engine.stream([prompt.input_ids, ...], GenerationOptions.for_task("tts")):
        ...  # StepOutput per row and group, as in mimo_tts.lm.generate.stream
    results = engine.generate(prompts, options)  # list[Generation], as the native generate

Text tokens are sampled by vLLM's sampler (temperature / top-k / top-p, per-request seed);
the patch decoder samples the codes in the worker with the request's own generator. A group's
codes are known one step after its token (they are decided when the token is fed back, see
model.py), so `stream` yields an `<|empty|>` group one step late, and right away at the finish.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from mimo_tts.errors import InputError, UsageError
from mimo_tts.lm.config import MAX_GROUPS
from mimo_tts.lm.generate import (
    Generation,
    GenerationOptions,
    StepOutput,
    resolve_stop_ids,
    split_prompt,
)
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


@dataclass
class _Request:
    """Engine-side view of one running request."""

    row: int
    key: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    codes: dict[int, Tensor] = field(default_factory=dict)  # generated index -> [F, K]
    emitted: int = 0
    finished: bool = False
    joins: int = 0


class VLLMEngine:
    """The MiMo-Audio LM served by vLLM (paged attention, continuous batching, tensor
    parallelism), generating like `mimo_tts.lm.generate` (an `lm.engine.Engine`; its batches
    are static to the caller: vLLM schedules the rows itself)."""

    name = "vllm"
    continuous = False

    def __init__(self, model_dir: str | Path, options: VLLMOptions | None = None):
        self.options = options = options or VLLMOptions()
        self.model_dir = Path(model_dir)
        self.cfg = load_config(self.model_dir)
        self.special = TextTokenizer.from_dir(self.model_dir).special
        self.last_joins: dict[int, int] = {}  # row -> batch joins in the last run (> 1: preempted)
        self._busy = False
        self.llm = _start_llm(self.model_dir, options, self.special.empty)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    # -- public API ---------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Tensor], options: GenerationOptions) -> list[Generation]:
        """Per prompt the new groups as ids [1 + K, F * N], like the native `generate`."""
        frames = self.cfg.group_size
        empty = torch.tensor(self.cfg.speech_empty_ids).unsqueeze(0).expand(frames, -1)
        blocks: list[list[Tensor]] = [[] for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        for out in self.stream(prompts, options):
            codes = empty if out.codes is None else out.codes  # [F, K]
            text = torch.full((1, frames), out.text_token, dtype=torch.long)
            blocks[out.index].append(torch.cat((text, codes.T.long()), dim=0))  # [1 + K, F]
            tokens[out.index].append(out.text_token)
        return [Generation(torch.cat(b, dim=1), t) for b, t in zip(blocks, tokens, strict=True)]

    def stream(self, prompts: Sequence[Tensor], options: GenerationOptions) -> Iterator[StepOutput]:
        """Yield each row's groups in order as soon as their codes are known.

        One stream at a time per engine: a stream steps the whole vLLM engine."""
        _check_options(options)
        if not prompts:
            raise InputError("no prompts to generate from")
        if self._busy:
            raise UsageError("this VLLMEngine is already streaming; finish that stream first")
        self._busy, self.last_joins, requests = True, {}, {}
        try:
            for row, ids in enumerate(prompts):
                req_id, request = self._add(row, ids, options)
                requests[req_id] = request
            yield from self._run(requests)
        finally:
            self._busy = False
            self._abandon(requests)

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

    def run_batch(self, source, rows: int, guard=None):
        raise UsageError("continuous batching runs on the native engine, not vLLM")

    def describe(self) -> dict:
        return {"name": self.name}

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- steps ---------------------------------------------------------------------------------
    def _add(self, row: int, ids: Tensor, options: GenerationOptions) -> tuple[str, _Request]:
        from vllm.inputs import TokensPrompt

        from mimo_tts.lm.vllm.state import request_args

        text, codes = split_prompt(self, ids.cpu(), self.special.empty)  # [G], [G, F, K]
        prompt_len = text.shape[0]
        if prompt_len >= self.max_model_len:
            raise InputError(f"prompt of {prompt_len} groups leaves no room under "
                             f"max_model_len {self.max_model_len}")
        audio_groups = (text == self.special.empty).nonzero()[:, 0].tolist()
        audio = {p: codes[p].tolist() for p in audio_groups}  # position -> [F][K]
        key = uuid.uuid4().hex
        seed = None if options.seed is None else options.seed + row
        params = self._sampling_params(options, prompt_len, seed,
                                       request_args(key, audio, options.audio_sampler, seed))
        req_id = f"mimo-{key}"  # outputs and aborts use this external id
        rendered = self.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=text.tolist())])
        self.llm.llm_engine.add_request(req_id, rendered[0], params)
        return req_id, _Request(row, key, prompt_len)

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

    def _run(self, requests: dict[str, _Request]) -> Iterator[StepOutput]:
        engine = self.llm.llm_engine
        while any(r.emitted < len(r.tokens) or not r.finished for r in requests.values()):
            if not engine.has_unfinished_requests():
                if any(not r.finished for r in requests.values()):
                    raise RuntimeError("vLLM stopped before every MiMo request finished")
            for out in engine.step():
                request = requests.get(out.request_id)
                if request is not None:
                    request.tokens = list(out.outputs[0].token_ids)
                    request.finished = out.finished
            self._collect(requests)
            for request in requests.values():
                yield from self._ready(request)

    def _collect(self, requests: dict[str, _Request]) -> None:
        """Fetch newly decided codes; finish (and drop the state of) finished requests."""
        live = [r for r in requests.values() if r.key is not None]
        if not live:
            return
        taken = self._rpc("mimo_audio_take", [r.key for r in live])
        for r in live:
            self._store(r, taken.get(r.key, []))
            if r.finished:
                position = r.prompt_len + len(r.tokens) - 1
                codes, r.joins = self._rpc("mimo_audio_finish", r.key, r.tokens[-1], position)
                self._store(r, codes)
                self.last_joins[r.row] = r.joins
                r.key = None

    def _store(self, request: _Request, decided: list) -> None:
        for position, codes in decided:
            request.codes[position - request.prompt_len] = torch.tensor(codes, dtype=torch.long)

    def _ready(self, r: _Request) -> Iterator[StepOutput]:
        while r.emitted < len(r.tokens):
            j, token = r.emitted, r.tokens[r.emitted]
            codes = None
            if token == self.special.empty:
                codes = r.codes.get(j)
                if codes is None:
                    if r.key is None:  # finished, yet never decided: a bug, not a wait
                        raise RuntimeError(f"no codes for audio group {j} of row {r.row}")
                    return
            r.emitted += 1
            yield StepOutput(r.row, j, token, codes, r.finished and r.emitted == len(r.tokens))

    def _abandon(self, requests: dict[str, _Request]) -> None:
        """Abort what is still running (an error or an abandoned iterator) and drop states."""
        if self.llm is None:
            return
        running = [rid for rid, r in requests.items() if not r.finished]
        if running:
            self.llm.llm_engine.abort_request(running)
        keys = [r.key for r in requests.values() if r.key is not None]
        if keys:
            self._rpc("mimo_audio_release", keys)

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
