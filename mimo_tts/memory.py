"""Memory preflight: what a run needs on each device, what the device has, and a refusal.

Before any weight is read, `plan` estimates each stage's memory from the checkpoints' safetensors
headers and config.json (weights in the run dtype, the LM's KV cache for the run's lengths, a
workspace), adds both stages up where they share a device, and compares with what the device
has: `MemAvailable` (and the cgroup limit, in a container) on the CPU, `torch.cuda.mem_get_info`
on CUDA. `check` turns a plan that does not fit into a one-line DeviceError (exit 4) naming the
need, the availability and the fixes, instead of a run that the kernel's OOM killer ends.

`MIMO_TTS_AVAILABLE_MEMORY` states the available memory instead of measuring it ("20GiB" for
every device, or "cpu=20GiB,cuda:0=70GiB"); only this module reads it. No torch here except
for CUDA's free-memory query.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.devices import DTYPE_BYTES
from mimo_tts.errors import DeviceError, UsageError

AVAILABLE_ENV = "MIMO_TTS_AVAILABLE_MEMORY"
GIB = 2**30
# Checkpoint tensors that are never loaded (EMA buffers of the RVQ, the LM's mel front-end).
UNLOADED = re.compile(r".*\._codebook\.(embed_avg|cluster_size|inited)|mel_transform\..*")
# Tokenizer buffers that stay float32 whatever the run dtype (RVQ codebooks, ISTFT window).
FLOAT32_BUFFERS = re.compile(r".*\._codebook\.embed|.*\.istft\.window")
# Codec linears that Stage-1 prepacks once more on CPU in bfloat16 (codec/layers.PackedLinear).
PACKED = re.compile(r".*layers\.\d+\.(self_attn\.(q|k|v|out)_proj|fc1|fc2)\.(weight|bias)")
RUNTIME_BYTES = 600 << 20  # the interpreter, torch, oneDNN/CUDA context and allocator slack
MIN_SAVING = 256 << 20  # a fix that saves less is not offered
# A prompt's groups before tokenising: the template and system turns, then at most one group
# per UTF-8 byte of text (text tokens are >= 1 byte); speech is ~0.5 groups per byte, so one
# group per byte also bounds the generated length when --max-new-groups is not given.
PROMPT_GROUPS = 96
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Lengths:
    """The run's sizes that memory depends on: rows per LM batch and groups per row."""

    batch: int = 1
    prompt_groups: int = PROMPT_GROUPS
    new_groups: int = 256

    @staticmethod
    def for_run(texts: list[str], batch_size: int, max_chars: int, max_new_groups: int | None,
                prompt_audio_groups: int = 0) -> Lengths:
        longest = max((len(t.encode("utf-8")) for t in texts), default=0)
        if max_chars:
            longest = min(longest, 4 * max_chars)  # split at max_chars (UTF-8: <= 4 bytes each)
        prompt = PROMPT_GROUPS + longest + prompt_audio_groups
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
    from mimo_tts.weights import read_header, weight_files

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


def lm_need(path: Path, device: str, dtype: str, lengths: Lengths) -> StageNeed:
    """LM weights, KV cache (backbone for prompt + new groups, patch decoder) and workspace."""
    from mimo_tts.lm.config import LMConfig
    from mimo_tts.weights import parse_config

    cfg = parse_config(path, LMConfig.from_json)  # the loader's own checks and messages
    back, local = cfg.backbone, cfg.patch_decoder
    layers, kv, head_dim, hidden = back.layers, back.kv_heads, back.head_dim, back.dim
    vocab, ffn, local_dim, local_layers = cfg.vocab_size, back.ffn_dim, local.dim, local.layers
    size = DTYPE_BYTES[dtype]
    groups = lengths.prompt_groups + lengths.new_groups
    kv_bytes = 2 * layers * kv * head_dim * groups * lengths.batch * size
    kv_bytes += 2 * local_layers * local_dim * cfg.local_steps * lengths.batch * size
    # Prefill activations of the widest layer (gate/up) and float32 logits rows.
    work = lengths.batch * lengths.prompt_groups * (2 * ffn + 4 * hidden) * size
    work += lengths.batch * vocab * 4 * 4
    return StageNeed("LM", device, dtype, {"weights": weights_bytes(path, dtype),
                                           "kv_cache": kv_bytes, "workspace": work}, path)


def tokenizer_need(path: Path, device: str, dtype: str, lengths: Lengths) -> StageNeed:
    """Audio-tokenizer weights and the decode workspace for the run's longest audio."""
    from mimo_tts.codec.config import CodecConfig
    from mimo_tts.weights import parse_config

    cfg = parse_config(path, CodecConfig.from_json)
    d_model, ffn, heads = cfg.d_model, cfg.decoder_ffn_dim, cfg.decoder_attention_heads
    frames = 2 * 4 * (lengths.prompt_groups + lengths.new_groups)  # 25 Hz codes -> 50 Hz
    size = max(DTYPE_BYTES[dtype], 4)  # norms and attention run in float32
    work = lengths.batch * frames * (4 * d_model + ffn) * size
    work += lengths.batch * heads * frames * min(frames, 1024) * 4  # attention blocks
    parts = {"weights": weights_bytes(path, dtype), "workspace": work}
    if device == "cpu" and dtype == "bfloat16":
        parts["packed_weights"] = sum(2 * n for name, (n, _) in header_numel(path).items()
                                      if PACKED.fullmatch(name))
    return StageNeed("tokenizer", device, dtype, parts, path)


def parse_size(text: str, source: str) -> int:
    """Bytes from "24GiB", "512M", "1.5g" or a plain number of bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"invalid memory size {text!r} (from {source}): use e.g. 16GiB or 900M")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def stated(env: Mapping[str, str]) -> dict[str, int]:
    """`MIMO_TTS_AVAILABLE_MEMORY` parsed: {"*": bytes} or {device: bytes}; {} when unset."""
    value = (env.get(AVAILABLE_ENV) or "").strip()
    source = f"env {AVAILABLE_ENV}"
    if not value:
        return {}
    if "=" not in value:
        return {"*": parse_size(value, source)}
    found = {}
    for part in value.split(","):
        name, _, size = part.partition("=")
        found[name.strip().lower()] = parse_size(size, source)
    return found


def stated_available(device: str, env: Mapping[str, str]) -> int | None:
    """The available memory `MIMO_TTS_AVAILABLE_MEMORY` states for `device`, if it does."""
    found = stated(env)
    return found.get(device, found.get("*"))


def _meminfo(field: str, meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of one /proc/meminfo field ("MemAvailable", "MemTotal"); None when unreadable."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup(name: str, root: str = "/sys/fs/cgroup") -> int | None:
    """A cgroup v2 memory figure of this process ("memory.max", "memory.current"); None when
    unset ("max") or unreadable."""
    try:
        value = Path(root, name).read_text().strip()
        return None if value == "max" else int(value)
    except (OSError, ValueError):
        return None


def _cgroup_available() -> int | None:
    """memory.max - memory.current of this process's cgroup v2, when a limit is set."""
    limit, current = _cgroup("memory.max"), _cgroup("memory.current")
    return None if limit is None or current is None else limit - current


def cpu_total(env: Mapping[str, str] | None = None) -> int | None:
    """The most memory this process can hold: MIMO_TTS_AVAILABLE_MEMORY's CPU figure when set,
    else MemTotal capped by the cgroup's memory.max; None when unknown."""
    stated = stated_available("cpu", os.environ if env is None else env)
    if stated is not None:
        return stated
    found = [v for v in (_meminfo("MemTotal"), _cgroup("memory.max")) if v is not None]
    return min(found) if found else None


def available(device: str, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(bytes available on `device`, where the number comes from); None when unknown."""
    env = os.environ if env is None else env
    stated = stated_available(device, env)
    if stated is not None:
        return stated, f"env {AVAILABLE_ENV}"
    if device == "cpu":
        found = [(v, s) for v, s in ((_meminfo("MemAvailable"), "MemAvailable"),
                                     (_cgroup_available(), "cgroup memory.max"))
                 if v is not None]
        return min(found) if found else (None, "unknown")
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, "torch.cuda.mem_get_info"
    return None, "unknown"  # mps: unified memory, no reliable free figure


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
        if need.stage == "tokenizer" and device == "cpu":  # bfloat16 adds its packed copy
            saving -= sum(2 * n for name, (n, _) in header_numel(need.path).items()
                          if PACKED.fullmatch(name)) if saving else 0
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
        raise DeviceError(
            f"not enough memory on {entry['device']}: the run needs about "
            f"{gib(entry['need_bytes'])} ({stages}, plus runtime) but "
            f"{gib(entry['available_bytes'])} is available ({entry['available_source']}); "
            f"use {'; or '.join(advice)}")
    return report
