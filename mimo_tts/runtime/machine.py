"""What memory the machine has, per device: the memory preflight's other half (what a run needs
is `synthesis/preflight.py`'s).

`available` gives a device's available bytes and where the figure came from: `MemAvailable` (and
the cgroup limit, in a container) on the CPU, `torch.cuda.mem_get_info` on CUDA.
`MIMO_TTS_AVAILABLE_MEMORY` states it instead of measuring ("20GiB" for every device, or
"cpu=20GiB,cuda:0=70GiB"); only this module reads it. `packed_fits` is the rule for copies the
CPU kernels make beside the mapped weights. No torch here except for CUDA's free-memory query.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from mimo_tts.errors import UsageError

AVAILABLE_ENV = "MIMO_TTS_AVAILABLE_MEMORY"
GIB = 2**30
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


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


def cpu_total(env: Mapping[str, str] | None = None) -> int | None:
    """The most memory this process can hold: MIMO_TTS_AVAILABLE_MEMORY's CPU figure when set,
    else MemTotal capped by the cgroup's memory.max; None when unknown."""
    stated = stated_available("cpu", os.environ if env is None else env)
    if stated is not None:
        return stated
    found = [v for v in (_meminfo("MemTotal"), _cgroup("memory.max")) if v is not None]
    return min(found) if found else None


PACK_HEADROOM = 4 << 30  # bytes left beside both stages' weights for the process and the cache


def packed_fits(beside: int, weights: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether `weights` bytes of packed (anonymous) tokenizer weights fit beside `beside`
    bytes of the LM's file-backed weights with PACK_HEADROOM to spare (`codec.gemm.choose`)."""
    total = cpu_total(env)
    return total is None or beside + weights + PACK_HEADROOM <= total


def available(device: str, env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(bytes available on `device`, where the number comes from); None when unknown."""
    env = os.environ if env is None else env
    stated = stated_available(device, env)
    if stated is not None:
        return stated, f"env {AVAILABLE_ENV}"
    if device == "cpu":  # and this process's cgroup v2: memory.max - memory.current
        limit, current = _cgroup("memory.max"), _cgroup("memory.current")
        cgroup = None if limit is None or current is None else limit - current
        found = [(v, s) for v, s in ((_meminfo("MemAvailable"), "MemAvailable"),
                                     (cgroup, "cgroup memory.max")) if v is not None]
        return min(found) if found else (None, "unknown")
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, "torch.cuda.mem_get_info"
    return None, "unknown"  # mps: unified memory, no reliable free figure
