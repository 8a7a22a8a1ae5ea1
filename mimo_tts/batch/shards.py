"""Shards: one run of many over the same input (`--shard K/N`, Slurm arrays, Indexed Jobs).

Shard K of N (K counts from 1) takes the items whose id hashes to it: sha256 of the UTF-8 id,
first 8 bytes, modulo N. The split depends on the id alone, so it holds across re-runs and
input reorderings, and for one N every item belongs to exactly one shard. Without `--shard`,
a Slurm array task (`SLURM_ARRAY_TASK_ID` from `SLURM_ARRAY_TASK_MIN` in steps of
`SLURM_ARRAY_TASK_STEP`, `SLURM_ARRAY_TASK_COUNT` tasks) or a Kubernetes Indexed Job pod
(`JOB_COMPLETION_INDEX`, 0-based, with `MIMO_TTS_SHARD_COUNT` set to the Job's completions)
picks its shard. `--shard 1/1` runs everything, as an unsharded run. No torch here.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from mimo_tts.errors import UsageError

COUNT_ENV = "MIMO_TTS_SHARD_COUNT"  # the shard count for JOB_COMPLETION_INDEX (Kubernetes)
MAX_SHARDS = 1_000_000
_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_TAG = re.compile(r"shard-(\d+)-of-(\d+)")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (1-based), and where that came from."""

    index: int
    count: int
    source: str = "flag"

    def __post_init__(self):
        if not 1 <= self.count <= MAX_SHARDS:
            raise UsageError(f"--shard {self.label}: N must be in [1, {MAX_SHARDS}]")
        if not 1 <= self.index <= self.count:
            raise UsageError(f"--shard {self.label}: K must be in [1, {self.count}] "
                             f"(K counts from 1){_where(self.source)}")

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def tag(self) -> str:
        """`shard-K-of-N`: the part of this shard's manifest and lock names."""
        return f"shard-{self.index}-of-{self.count}"

    def owns(self, item_id: str) -> bool:
        return shard_of(item_id, self.count) == self.index

    def describe(self) -> dict:
        return {"shard": self.label, "index": self.index, "count": self.count,
                "source": self.source}


def shard_of(item_id: str, count: int) -> int:
    """The shard (1-based) of `count` that an item id belongs to."""
    digest = hashlib.sha256(item_id.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def parse(spec: str, source: str = "flag") -> Shard:
    """`K/N` -> Shard (UsageError, exit 2, for anything else)."""
    match = _SPEC.fullmatch(str(spec))
    if match is None:
        raise UsageError(f"--shard must be K/N with 1 <= K <= N (K counts from 1), got {spec!r}"
                         f"{_where(source)}")
    return Shard(int(match[1]), int(match[2]), source)


def parse_tag(name: str) -> tuple[int, int] | None:
    """(K, N) from a name holding `shard-K-of-N`, or None."""
    match = _TAG.search(name)
    return (int(match[1]), int(match[2])) if match else None


def resolve_shard(flag: str | None, env: Mapping[str, str] | None = None) -> Shard | None:
    """flag > Slurm array > Indexed Job (`env`, default the process's) > none; N = 1 is no
    shard."""
    shard = parse(flag) if flag is not None else _from_env(os.environ if env is None else env)
    return shard if shard is not None and shard.count > 1 else None


def _from_env(env: Mapping[str, str]) -> Shard | None:
    if env.get("SLURM_ARRAY_TASK_ID"):
        names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP",
                 "SLURM_ARRAY_TASK_COUNT")
        task, low, step, count = (_env_int(env, n, default) for n, default in
                                  zip(names, (None, 0, 1, None), strict=True))
        source = "env " + ", ".join(f"{n}={env[n]}" for n in names if env.get(n))
        _check_count("SLURM_ARRAY_TASK_COUNT", count)
        offset = task - low
        if step < 1 or offset < 0 or offset % step:
            raise UsageError(f"cannot place array task {task} among shards ({source}); "
                             "pass --shard K/N")
        if offset // step >= count:
            raise UsageError(f"array task {task} would be shard {offset // step + 1}, past "
                             f"SLURM_ARRAY_TASK_COUNT={count} ({source}); pass --shard K/N")
        return Shard(offset // step + 1, count, source)
    if env.get("JOB_COMPLETION_INDEX"):
        index = _env_int(env, "JOB_COMPLETION_INDEX", None)
        if not env.get(COUNT_ENV):
            raise UsageError(f"JOB_COMPLETION_INDEX={index} is set but {COUNT_ENV} is not: set "
                             f"it to the Job's completions, or pass --shard K/N")
        count = _env_int(env, COUNT_ENV, None)
        _check_count(COUNT_ENV, count)
        if not 0 <= index < count:
            raise UsageError(f"JOB_COMPLETION_INDEX={index} must be in [0, {count - 1}] "
                             f"(it counts from 0, below {COUNT_ENV}={count}); pass --shard K/N")
        return Shard(index + 1, count,
                     f"env JOB_COMPLETION_INDEX={index}, {COUNT_ENV}={count}")
    return None


def _check_count(name: str, count: int) -> None:
    if not 1 <= count <= MAX_SHARDS:
        raise UsageError(f"{name}={count} is not a shard count in [1, {MAX_SHARDS}]; "
                         "pass --shard K/N")


def _env_int(env: Mapping[str, str], name: str, default: int | None) -> int:
    value = env.get(name)
    if not value:
        if default is None:
            raise UsageError(f"{name} is not set; pass --shard K/N")
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not an integer; pass --shard K/N") from None


def _where(source: str) -> str:
    return "" if source == "flag" else f" (from {source})"
