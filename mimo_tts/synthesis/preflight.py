"""The preflight (`mimo-tts devices`, `synth --dry-run`, and before loading), loading nothing.

Placement with the source of every value, CUDA facts, where each checkpoint would come from,
the memory each stage needs at the run dtype (from `config.json` and safetensors headers)
against what its device has (`runtime/machine.py`), the refusal that does not fit (exit 4), and
the Stage-0 engine's settings. torch is imported only when a GPU may be present
(`devices.Probe`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib.util import find_spec
from pathlib import Path

from mimo_tts import presets
from mimo_tts.errors import CheckpointError, DeviceError, NotEnoughMemoryError, UsageError
from mimo_tts.lm.config import W4_GROUP
from mimo_tts.lm.engine import engine_spec
from mimo_tts.runtime.devices import DTYPE_BYTES, Probe
from mimo_tts.runtime.machine import GIB, available, gib, stated
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.settings import Settings


def lengths_for(settings: Settings, texts: list[str], rows: int | None = None,
                encodes: bool = True, decode_rows: int | None = None) -> Lengths:
    """The run's sizes memory depends on: `rows` prompts at a time (default `batch_size`);
    `encodes`: whether it may encode a prompt recording (the tokenizer's encoder is read);
    `decode_rows`: audios Stage-1 decodes at once (default: an item's most text pieces, which
    `synth` decodes together)."""
    o = settings.synthesis
    lengths = Lengths.for_run(texts, settings.run.batch_size if rows is None else rows,
                              o.max_chars, o.max_new_groups)
    if decode_rows is None:
        decode_rows = max((len(script(t, o).texts) for t in texts), default=1)
    return replace(lengths, encodes=encodes, decode_rows=max(1, decode_rows))


def memory_needs(settings: Settings, lm_path: Path | None, tok_path: Path | None,
                 lengths: Lengths) -> list[StageNeed]:
    """Per-stage memory estimates for this run's placement and lengths (vLLM sizes its own)."""
    p, needs = settings.placement, []
    if lm_path is not None and not engine_spec(settings.engine.engine).sizes_own_memory:
        needs.append(lm_need(lm_path, p.lm_device.value, p.lm_dtype.value, lengths,
                             settings.engine.lm_quant))
    if tok_path is not None:
        needs.append(tokenizer_need(tok_path, p.tokenizer_device.value,
                                    p.tokenizer_dtype.value, lengths))
    return needs


def check_memory(settings: Settings, refs, lengths: Lengths,
                 env: Mapping[str, str] | None = None, log=None) -> list[dict]:
    """The memory plan before loading; a run that cannot fit is refused (DeviceError, exit 4)
    unless `no_memory_check`."""
    lm, tok = refs  # lm None: Stage-1 alone
    try:
        needs = memory_needs(settings, lm.path if lm else None, tok.path, lengths)
    except CheckpointError as exc:  # loading reports it, with the file at fault
        (log or (lambda message: None))(f"memory preflight skipped: {exc}")
        return []
    if settings.engine.no_memory_check:
        return plan(needs, env)
    return check(needs, lengths, env)


def engine_record(settings: Settings, loaded: dict | None = None) -> dict:
    """The Stage-0 engine and its settings (sidecar, preflight); the engine is not imported."""
    spec = engine_spec(settings.engine.engine)
    if spec.settings_module is None:
        return loaded or {"name": spec.name}
    record: dict = {"name": spec.name}
    try:
        record["settings"] = spec.settings(settings.engine, settings.placement)
    except UsageError as exc:
        record["error"] = str(exc)
    return record


def preflight(settings: Settings, texts: list[str] = (), env: Mapping[str, str] | None = None,
              encodes: bool = True) -> dict:
    """Placement with sources, CUDA facts, checkpoint presence and the memory plan (`encodes`:
    whether the run may encode a prompt recording, see `lengths_for`).

    `memory_error` is set when the run would be refused (the CLI then exits 4).
    """
    probe, placement = Probe.detect(), settings.placement
    report = {"placement": placement.describe(),
              "cuda": {"available": probe.cuda_count > 0, "device_count": probe.cuda_count,
                       "current": probe.cuda_current if probe.cuda_count else None},
              "mps": probe.mps, "checkpoints": {}}
    names = settings.checkpoints
    for role, (name, src) in (("model", names.lm), ("tokenizer", names.tokenizer)):
        path, status = presets.locate(name, src, role, env)
        report["checkpoints"][role] = {"name": name, "source": src, "status": status,
                                       "path": str(path) if path else None}
    paths = [report["checkpoints"][r]["path"] for r in ("model", "tokenizer")]
    lengths = lengths_for(settings, list(texts), encodes=encodes)
    try:
        needs = memory_needs(settings, *(Path(x) if x else None for x in paths), lengths)
        report["memory"] = plan(needs, env)
        check(needs, lengths, env)
    except DeviceError as exc:  # the run would be refused
        report["memory_error"] = str(exc)
    except CheckpointError as exc:  # the checkpoint entries report the cause
        report["memory"] = {"error": str(exc)}
    report["engine"] = engine_record(settings)
    spec = engine_spec(settings.engine.engine)
    if spec.needs is not None:
        report["engine"]["installed"] = find_spec(spec.needs) is not None
    return report


# Checkpoint tensors that are never loaded (EMA buffers of the RVQ, the LM's mel front-end).
UNLOADED = re.compile(r".*\._codebook\.(embed_avg|cluster_size|inited)|mel_transform\..*")


# Tokenizer buffers that stay float32 whatever the run dtype (RVQ codebooks, ISTFT window).
FLOAT32_BUFFERS = re.compile(r".*\._codebook\.embed|.*\.istft\.window")



# Memory-mapped tensors a run reads only in part (see `resident_bytes`): the LM's text
# embedding (the rows of the tokens it sees) and the tokenizer's encoder (all but the
# quantizer's codebooks, which decoding reads), untouched unless a prompt recording is encoded.
ENCODER = re.compile(r"encoder\.(?!quantizer\.).*")

# safetensors dtype codes of the run dtypes: a tensor stored so is used in place.
STORED = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

PAGE = 4096

# The interpreter, torch, oneDNN/CUDA context and allocator slack, with room for how machines
# differ: at full size in bfloat16 the estimate is then 1.02x (one item) and 1.03x (a batch
# of 8) the peak RSS measured by scripts/bench_e2e.py on a 2-core AVX2 EPYC (README, memory).
RUNTIME_BYTES = 800 << 20

MIN_SAVING = 256 << 20  # a fix that saves less is not offered


# A prompt's groups before tokenising: the template and system turns, then at most one group
# per UTF-8 byte of text (text tokens are >= 1 byte); speech is ~0.5 groups per byte, so one
# group per byte also bounds the generated length when --max-new-groups is not given.
PROMPT_GROUPS = 96


@dataclass(frozen=True)
class Lengths:
    """The run's sizes that memory depends on: rows per LM batch and groups per row."""

    batch: int = 1
    prompt_groups: int = PROMPT_GROUPS
    new_groups: int = 256
    encodes: bool = True  # a prompt recording may be encoded (the faces that cannot tell)
    decode_rows: int = 1  # audios Stage-1 decodes in one call

    @staticmethod
    def for_run(texts: list[str], batch_size: int, max_chars: int,
                max_new_groups: int | None) -> Lengths:
        longest = max((len(t.encode("utf-8")) for t in texts), default=0)
        if max_chars:
            longest = min(longest, 4 * max_chars)  # split at max_chars (UTF-8: <= 4 bytes each)
        prompt = PROMPT_GROUPS + longest
        new = max_new_groups if max_new_groups is not None else max(longest, 64)
        return Lengths(batch=max(1, min(batch_size, len(texts) or 1)), prompt_groups=prompt,
                       new_groups=new)


@dataclass
class StageNeed:
    """One stage's estimate on its device: named parts in bytes."""

    stage: str
    device: str
    dtype: str
    parts: dict[str, int] = field(default_factory=dict)
    path: Path | None = None

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def header_numel(path: Path) -> dict[str, tuple[int, str]]:
    """name -> (elements, safetensors dtype) for every tensor of a checkpoint (headers only)."""
    from mimo_tts.runtime.safetensors import read_header, weight_files

    out: dict[str, tuple[int, str]] = {}
    for file in weight_files(path):
        for name, info in read_header(file).items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            count = 1
            for dim in info.get("shape", ()):
                count *= int(dim)
            out[name] = (count, str(info.get("dtype")))
    return out


def weights_bytes(path: Path, dtype: str) -> int:
    """Bytes of the loaded weights in `dtype` (float32 buffers stay float32; EMA state unread)."""
    total = 0
    for name, (count, _) in header_numel(path).items():
        if UNLOADED.fullmatch(name):
            continue
        total += count * (4 if FLOAT32_BUFFERS.fullmatch(name) else DTYPE_BYTES[dtype])
    return total


def resident_bytes(path: Path, dtype: str, device: str, unread=None,
                   partial: dict | None = None, quantized=None) -> int:
    """Bytes of the loaded weights that become resident in a run, in `dtype`.

    Weights copied to a device or converted to another dtype are all resident. On the CPU, a
    tensor stored in the run dtype stays memory-mapped, and only the pages a run reads become
    resident: none of those matching `unread`, and at most `partial[name]` bytes of the others
    named there (an embedding's rows). Those matching `quantized` (a pattern and the bytes an
    element) are quantized copies. Everything else counts whole, as in `weights_bytes`.
    """
    total = 0
    for name, (count, stored) in header_numel(path).items():
        if UNLOADED.fullmatch(name):
            continue
        keep = FLOAT32_BUFFERS.fullmatch(name)
        if quantized is not None and quantized[0].fullmatch(name):
            total += int(count * quantized[1])
            continue
        size = count * (4 if keep else DTYPE_BYTES[dtype])
        mapped = device == "cpu" and stored == STORED["float32" if keep else dtype]
        if mapped and unread is not None and unread.fullmatch(name):
            continue
        if mapped and partial and name in partial:
            size = min(size, partial[name])
        total += size
    return total


# The LM matrices each opt-in quantization keeps as quantized copies (out of the mapping), and
# their bytes an element: `lm.int8.matrices` for int8, every streamed matrix for w8a8 and w4a8
# (`MiMoAudioLM.streamed_matrices`; w4a8: half a byte and a float16 scale per 32).
_PROJ = r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight"
_STREAMED = re.compile(rf"(model|local_transformer|input_local_transformer)\.layers\.\d+\.{_PROJ}"
                       r"|lm_head\.weight|(speech_group|hidden_states)_downcast\.weight"
                       r"|speech_embeddings_to_local\.weight")
QUANTIZED = {
    "int8": (re.compile(rf"(model|local_transformer)\.layers\.\d+\.{_PROJ}|lm_head\.weight"), 1.0),
    "w8a8": (_STREAMED, 1.0),
    "w4a8": (_STREAMED, 0.5 + 2 / W4_GROUP),
}


def lm_need(path: Path, device: str, dtype: str, lengths: Lengths,
            quant: str | None = None) -> StageNeed:
    """LM weights, KV cache (backbone for prompt + new groups, patch decoder) and workspace;
    with `quant`, its int8 matrices at one byte an element."""
    from mimo_tts.lm.config import LMConfig
    from mimo_tts.runtime.safetensors import parse_config

    cfg = parse_config(path, LMConfig.from_json)  # the loader's own checks and messages
    back, local = cfg.backbone, cfg.patch_decoder
    layers, kv, head_dim, hidden = back.layers, back.kv_heads, back.head_dim, back.dim
    vocab, ffn, local_dim, local_layers = cfg.vocab_size, back.ffn_dim, local.dim, local.layers
    size = DTYPE_BYTES[dtype]
    groups = lengths.prompt_groups + lengths.new_groups
    kv_bytes = 2 * layers * kv * head_dim * groups * lengths.batch * size
    kv_bytes += 2 * local_layers * local_dim * cfg.local_steps * lengths.batch * size
    # Prefill activations of the widest layer (gate/up) and float32 logits rows; on the CPU a
    # product may sum in float32 before its rows round (`lm.model.upcast_linear`).
    act = size + 4 if device == "cpu" and size < 4 else size
    work = lengths.batch * lengths.prompt_groups * (2 * ffn + 4 * hidden) * act
    work += lengths.batch * vocab * 4 * 4
    # The text embedding's rows read: at most one per token the run sees, each on its pages.
    rows = lengths.batch * groups * cfg.group_size
    embedding = {"model.embed_tokens.weight": rows * (hidden * size + PAGE)}
    weights = resident_bytes(path, dtype, device, partial=embedding,
                             quantized=QUANTIZED.get(quant or ""))
    return StageNeed("LM", device, dtype, {"weights": weights, "kv_cache": kv_bytes,
                                           "workspace": work}, path)


def tokenizer_need(path: Path, device: str, dtype: str, lengths: Lengths) -> StageNeed:
    """Audio-tokenizer weights and the decode workspace for the run's longest audio; the
    encoder's weights only where read: a prompt encoded (packed float32 layers replace the
    weights they pack, the encoder's on its first use: `codec.layers.prepack`)."""
    from mimo_tts.codec.config import BATCH_FRAMES, DECODE_CHUNK_FRAMES, CodecConfig
    from mimo_tts.runtime.safetensors import parse_config

    cfg = parse_config(path, CodecConfig.from_json)
    d_model, ffn, heads = cfg.d_model, cfg.decoder_ffn_dim, cfg.decoder_attention_heads
    frames = 2 * 4 * (lengths.prompt_groups + lengths.new_groups)  # 25 Hz codes -> 50 Hz
    size = max(DTYPE_BYTES[dtype], 4)  # norms and attention run in float32
    # decode_batch pads at most BATCH_FRAMES latent frames (25 Hz) a pass, or one chunk
    rows_frames = min(lengths.decode_rows * frames, 2 * max(BATCH_FRAMES, DECODE_CHUNK_FRAMES))
    work = rows_frames * (4 * d_model + ffn) * size
    work += heads * rows_frames * min(frames, 1024) * 4  # attention blocks
    weights = resident_bytes(path, dtype, device,
                             None if lengths.encodes else ENCODER)
    # packed CPU linears (codec.layers.prepack) replace the weights they pack: no copy
    return StageNeed("tokenizer", device, dtype, {"weights": weights, "workspace": work}, path)


def plan(needs: list[StageNeed], env: Mapping[str, str] | None = None) -> list[dict]:
    """Per device: the stages on it, their parts, the total need and the availability."""
    env = os.environ if env is None else env
    stated(env)  # a malformed value is a usage error even when nothing needs checking
    devices: dict[str, list[StageNeed]] = {}
    for need in needs:
        devices.setdefault(need.device, []).append(need)
    report = []
    for device, stages in devices.items():
        total = RUNTIME_BYTES + sum(s.total for s in stages)
        have, source = available(device, env)
        report.append({
            "device": device, "need_bytes": total, "need_gib": round(total / GIB, 2),
            "available_bytes": have, "available_source": source,
            "available_gib": None if have is None else round(have / GIB, 2),
            "fits": have is None or total <= have,
            "stages": {s.stage: {"dtype": s.dtype, **s.parts} for s in stages},  # bytes
        })
    return report


def fixes(needs: list[StageNeed], device: str, lengths: Lengths) -> list[str]:
    """The changes that would shrink the need on `device`, biggest saving first."""
    found = []
    for need in needs:
        if need.device != device:
            continue
        saving = need.parts["weights"] // 2 if need.dtype == "float32" else 0
        flag = "--dtype bfloat16" if need.stage == "LM" else "--tokenizer-dtype bfloat16"
        if saving > MIN_SAVING:
            found.append((saving, f"{flag} (saves {gib(saving)})"))
        if need.stage == "tokenizer" and device != "cpu":
            found.append((need.total, f"--tokenizer-device cpu (saves {gib(need.total)})"))
        if need.stage == "LM" and need.parts["kv_cache"] > 256 << 20:
            found.append((need.parts["kv_cache"] // 2, "a smaller --max-new-groups or "
                                                       "--batch-size"))
    return [text for _, text in sorted(found, key=lambda pair: -pair[0])]


def check(needs: list[StageNeed], lengths: Lengths, env: Mapping[str, str] | None = None
          ) -> list[dict]:
    """The plan, or a DeviceError (exit 4) for the first device it does not fit on."""
    report = plan(needs, env)
    for entry in report:
        if entry["fits"]:
            continue
        stages = ", ".join(f"{n.stage} {gib(n.total)} in {n.dtype}" for n in needs
                           if n.device == entry["device"])
        advice = fixes(needs, entry["device"], lengths) + ["--no-memory-check to try anyway"]
        raise NotEnoughMemoryError(
            f"not enough memory on {entry['device']}: the run needs about "
            f"{gib(entry['need_bytes'])} ({stages}, plus runtime) but "
            f"{gib(entry['available_bytes'])} is available ({entry['available_source']}); "
            f"use {'; or '.join(advice)}")
    return report
