"""Which checkpoints, and the loaded models: directory / HF id in the local cache / `tiny`.

Resolution never downloads unless the caller allows it; a missing model is a CheckpointError
that spells out the command that would fetch it. Nothing here loads weights: `checkpoint_report`
and `estimate_memory` read only `config.json` and safetensors headers (JSON), for preflights.
`Engine` holds the loaded LM, text tokenizer and audio tokenizer and the glue between them
(prompt building, sampler settings, batched generation + extraction, Stage-1 decode).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from mimo_tts import io as mio
from mimo_tts.errors import CheckpointError, DeviceError, UsageError

DEFAULT_MODEL = "XiaomiMiMo/MiMo-Audio-7B-Instruct"
DEFAULT_TOKENIZER = "XiaomiMiMo/MiMo-Audio-Tokenizer"
TOKENIZER_PATH_ENV = "MIMO_AUDIO_TOKENIZER_PATH"
CACHE_ENV = "MIMO_TTS_CACHE"
TINY = "tiny"
TINY_PRESET_VERSION = 1
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class ModelRef:
    """A resolved checkpoint: what was asked, where it came from, and the local directory."""

    name: str
    source: str
    kind: str  # "directory" | "hf-cache" | "download" | "preset"
    path: Path | None
    revision: str | None = None

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "kind": self.kind,
                "path": str(self.path) if self.path else None, "revision": self.revision}


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mimo-tts"


def tiny_preset_dir(env=None, seed: int = 0) -> Path:
    return cache_root(env) / "presets" / f"tiny-v{TINY_PRESET_VERSION}-seed{seed}"


def ensure_tiny_preset(env=None, seed: int = 0) -> tuple[Path, Path]:
    """The tiny preset's (lm, tokenizer) directories, written once (atomically) when missing."""
    final = tiny_preset_dir(env, seed)
    if (final / "complete").is_file():
        return final / "lm", final / "tokenizer"
    from mimo_tts.presets import write_tiny_preset

    staging = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        write_tiny_preset(staging, seed=seed)
        (staging / "complete").write_text("ok\n")
        if final.exists():  # an incomplete earlier attempt
            _remove_tree(final)
        os.replace(staging, final)
    except OSError as exc:
        if not (final / "complete").is_file():  # another process may have won the race
            raise CheckpointError(f"cannot write the tiny preset to {final}: {exc}") from None
    finally:
        _remove_tree(staging)
    return final / "lm", final / "tokenizer"


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def fetch_hint(repo_id: str) -> str:
    return (f"fetch it with `mimo-tts download` (or `hf download {repo_id}`, "
            f"formerly `huggingface-cli download {repo_id}`)")


def _from_hf_cache(repo_id: str, source: str, allow_download: bool) -> ModelRef:
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=not allow_download))
    except Exception as exc:  # the hub raises many types (offline, not cached, HTTP)
        if allow_download:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(f"could not download {repo_id} (is this machine online? "
                                  f"HF_ENDPOINT / HF_TOKEN may be needed): {reason}") from None
        raise CheckpointError(f"model {repo_id} is not in the local Hugging Face cache "
                              f"({_hf_cache_dir()}); {fetch_hint(repo_id)}") from None
    kind = "download" if allow_download else "hf-cache"
    return ModelRef(repo_id, source, kind, path, revision=path.name)


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(name: str, source: str, role: str, allow_download: bool = False,
            env=None, seed: int = 0) -> ModelRef:
    """Resolve one checkpoint name (`tiny`, a directory, or an HF repo id) to a local dir."""
    if name == TINY:
        lm_dir, tok_dir = ensure_tiny_preset(env, seed)
        return ModelRef(TINY, source, "preset", lm_dir if role == "model" else tok_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelRef(name, source, "directory", path.resolve(), _snapshot_revision(path))
    if _REPO_ID.match(name) and not name.startswith((".", "/", "~")):
        return _from_hf_cache(name, source, allow_download)
    raise CheckpointError(f"{role} checkpoint directory not found: {name} (from {source})")


def _snapshot_revision(path: Path) -> str | None:
    """The commit hash when `path` is an HF cache snapshot directory."""
    resolved = path.resolve()
    if resolved.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", resolved.name):
        return resolved.name
    return None


def pick_names(model: str | None, tokenizer: str | None, profile: Mapping | None = None,
               env: Mapping[str, str] | None = None) -> tuple[tuple[str, str], tuple[str, str]]:
    """(name, source) for the LM and the tokenizer: flag > env > profile > default."""
    env = os.environ if env is None else env
    profile = profile or {}
    lm = _first((model, "flag"), (profile.get("model"), "config"), (DEFAULT_MODEL, "default"))
    tok_env = env.get(TOKENIZER_PATH_ENV) or None
    if tok_env is not None and not Path(tok_env).expanduser().is_dir():
        raise CheckpointError(f"{TOKENIZER_PATH_ENV}={tok_env!r} is not a directory; it must "
                              "point to a local copy of the MiMo-Audio tokenizer")
    default_tok = TINY if lm[0] == TINY else DEFAULT_TOKENIZER
    tok = _first((tokenizer, "flag"), (tok_env, f"env {TOKENIZER_PATH_ENV}"),
                 (profile.get("tokenizer"), "config"), (default_tok, "default"))
    return lm, tok


def _first(*candidates):
    return next((str(v), s) for v, s in candidates if v is not None)


def resolve_models(model=None, tokenizer=None, profile=None, env=None,
                   allow_download: bool = False, seed: int = 0) -> tuple[ModelRef, ModelRef]:
    """Both checkpoints, resolved to local directories (the tiny preset is written if needed)."""
    (lm_name, lm_src), (tok_name, tok_src) = pick_names(model, tokenizer, profile, env)
    lm = resolve(lm_name, lm_src, "model", allow_download, env, seed)
    tok = resolve(tok_name, tok_src, "tokenizer", allow_download, env, seed)
    return lm, tok


def download(repo_ids: list[str]) -> list[ModelRef]:
    """Fetch checkpoints into the Hugging Face cache (needs network access)."""
    return [_from_hf_cache(repo_id, "download", allow_download=True) for repo_id in repo_ids]


# --- preflight (no weights are read) ------------------------------------------------------------


def locate(name: str, source: str, role: str, env=None) -> tuple[Path | None, str]:
    """Where a checkpoint would be found, without writing or downloading: (path, status)."""
    if name == TINY:
        root = tiny_preset_dir(env)
        sub = root / ("lm" if role == "model" else "tokenizer")
        ok = (root / "complete").is_file()
        return (sub, "present (tiny preset)") if ok else (None, "tiny preset, built on first use")
    try:
        ref = resolve(name, source, role, allow_download=False, env=env)
    except CheckpointError as exc:
        return None, f"missing: {exc}"
    return ref.path, "present"


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        if size > 100_000_000:
            raise CheckpointError(f"corrupt safetensors header in {path}")
        return json.loads(handle.read(size))


def estimate_memory(path: Path, dtype_bytes: int, kv_groups: int = 8192) -> dict:
    """Bytes of weights at the run dtype (from safetensors headers) plus the LM KV cache."""
    from mimo_tts.weights import read_config, weight_files

    numel = 0
    for file in weight_files(path):
        for name, info in _safetensors_header(file).items():
            if name != "__metadata__" and info.get("dtype") in _DTYPE_BYTES:
                count = 1
                for dim in info["shape"]:
                    count *= dim
                numel += count
    config = read_config(path)
    kv = 0
    if "num_hidden_layers" in config and "num_key_value_heads" in config:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
        kv *= kv_groups * dtype_bytes
    return {"parameters": numel, "weights_bytes": numel * dtype_bytes, "kv_cache_bytes": kv,
            "total_gib": round((numel * dtype_bytes + kv) / 2**30, 3)}


@dataclass
class Piece:
    """One generated text piece: its prompt record, generated ids, codes and audio."""

    prompt: object  # mimo_tts.tasks.Prompt
    seed: int
    new_text_ids: list[int]
    text: str
    codes: object | None  # [8, T] int64, None when no audio was generated
    audio: object | None = None  # [960 T] float32 once decoded
    note: str | None = None


@contextmanager
def oom_advice(stage: str, device: str):
    """Turn an out-of-memory error into a DeviceError (exit 4) with what to try instead."""
    try:
        yield
    except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError
        if "out of memory" not in str(exc).lower():
            raise
        raise DeviceError(f"out of memory on {device} during {stage}; try --tokenizer-device "
                          "cpu, a smaller --batch-size or a smaller --max-chars") from None


# --- loaded models: the glue between Stage-0 and Stage-1 ------------------------------------


class Engine:
    """The loaded LM, text tokenizer and audio tokenizer, with the glue between them."""

    def __init__(self, lm, text, codec):
        self.lm, self.text, self.codec = lm, text, codec
        self.empty_ids = list(lm.cfg.speech_empty_ids)
        self.group_size = lm.cfg.group_size
        self.samples_per_frame = codec.samples_per_frame
        self.lm_device = str(lm.lm_head.weight.device)
        self._prompt_codes: dict[str, object] = {}

    @classmethod
    def load(cls, lm_path: Path, tok_path: Path, placement, log) -> Engine:
        from mimo_tts.codec import load_audio_tokenizer
        from mimo_tts.lm.load import load_lm
        from mimo_tts.lm.text import TextTokenizer

        text = TextTokenizer.from_dir(lm_path)
        lm = load_lm(lm_path, placement.lm_device.value, placement.lm_dtype.value)
        log(f"LM loaded from {lm_path}")
        codec = load_audio_tokenizer(tok_path, placement.tokenizer_device.value,
                                     placement.tokenizer_dtype.value,
                                     cuda_graph=bool(placement.cuda_graph.value))
        log(f"audio tokenizer loaded from {tok_path}")
        return cls(lm, text, codec)

    def prompt(self, task, text, instruct, prompt_audio, template, seed):
        """The task prompt (mimo_tts.tasks.Prompt); a voice prompt is encoded on first use."""
        from mimo_tts.tasks import TASKS, build_prompt

        if task not in TASKS:
            raise UsageError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        codes = self.prompt_codes(prompt_audio) if prompt_audio else None
        return build_prompt(task, text, self.text, self.empty_ids, instruct=instruct,
                            prompt_codes=codes, template=template, seed=seed)

    def prompt_codes(self, path: str):
        """Voice-prompt codes [8, T'] (encoded on the tokenizer device once per file)."""
        if path not in self._prompt_codes:
            audio, rate = mio.read_audio(path)
            with oom_advice("prompt-audio encode", str(self.codec.device)):
                self._prompt_codes[path] = self.codec.encode_prompt(audio, rate).cpu()
        return self._prompt_codes[path]

    def samplers(self, o):
        """(text, audio) SamplerConfig: the task's official defaults with option overrides."""
        from mimo_tts.lm.sampling import SamplerConfig, task_samplers
        from mimo_tts.tasks import TASKS

        text, audio = task_samplers(TASKS[o.task].sampler if o.task in TASKS else "tts")

        def pick(base, temperature, top_k, top_p):
            return SamplerConfig(base.temperature if temperature is None else temperature,
                                 base.top_k if top_k is None else (top_k or None),
                                 base.top_p if top_p is None else top_p)

        return (pick(text, o.temperature, o.top_k, o.top_p),
                pick(audio, o.audio_temperature, o.audio_top_k, o.audio_top_p))

    def sampler_record(self, o) -> dict:
        text, audio = self.samplers(o)
        return {"text": asdict(text), "audio": asdict(audio)}

    def generation_options(self, o, seed: int):
        """GenerationOptions for a run: samplers, seed, group cap and the task's stop set."""
        from mimo_tts.lm.config import MAX_GROUPS
        from mimo_tts.lm.generate import GenerationOptions
        from mimo_tts.tasks import TASKS

        text, audio = self.samplers(o)
        stops = TASKS[o.task].stop_tokens if o.task in TASKS else ("eos", "eostm", "im_end")
        return GenerationOptions(text_sampler=text, audio_sampler=audio, seed=seed,
                                 max_new_groups=o.max_new_groups or MAX_GROUPS,
                                 stop_tokens=stops)

    def generate_pieces(self, prompts, options, seed: int, batch_size: int) -> list[Piece]:
        """Stage-0 for prompts, `batch_size` at a time, then extraction (spec §4.8)."""
        from mimo_tts.lm.extract import extract
        from mimo_tts.lm.generate import generate

        pieces = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            with oom_advice("Stage-0 generation", self.lm_device):
                outs = generate(self.lm, [p.input_ids for p in batch], options,
                                self.text.special)
            for prompt, out in zip(batch, outs, strict=True):
                found = extract(out.new_ids, self.text, self.empty_ids, self.group_size)
                pieces.append(Piece(prompt, seed, list(found.text_tokens), found.text,
                                    found.codes))
        return pieces

    def decode(self, codes_list: list) -> list:
        """Stage-1 on the tokenizer device: [8, T] codes -> [960 T] float32 audio each."""
        with oom_advice("Stage-1 decode", str(self.codec.device)):
            return self.codec.decode_batch(list(codes_list))
