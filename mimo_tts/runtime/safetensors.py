"""Checkpoint files: config.json and safetensors weights (single file or sharded index).

Only JSON and safetensors are ever read: nothing is unpickled and no remote code runs. Every
failure names the file or tensor at fault as a CheckpointError.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from mimo_tts.errors import CheckpointError

T = TypeVar("T")

SINGLE_FILE = "model.safetensors"
_SHARD_NAME = re.compile(r"[\w.-]+\.safetensors")  # a plain file name: no "/" or ".."
INDEX_FILE = "model.safetensors.index.json"


def read_config(directory: str | Path) -> dict:
    """Parse `config.json` of a checkpoint directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"missing config.json in {directory}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"unreadable {path}: {exc}") from None


def parse_config(directory: str | Path, parse: Callable[[dict], T]) -> T:
    """`parse` (LMConfig.from_json, CodecConfig.from_json) of a checkpoint's config.json, its
    errors naming the file: `<dir>/config.json: field 'x' = ... must be ...`."""
    config = read_config(directory)
    path = Path(directory) / "config.json"
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    try:
        return parse(config)
    except CheckpointError as exc:
        message = str(exc).split("config.json: ", 1)[-1]  # the parser's own prefix, if any
        raise CheckpointError(f"{path}: {message}") from None


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard the index names."""
    directory = Path(directory)
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if not indexes:
        shards = sorted(directory.glob("*.safetensors"))
        if shards:
            return shards
        raise CheckpointError(f"no {SINGLE_FILE} or *.safetensors.index.json in {directory}")
    try:
        weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise CheckpointError(f"unreadable index {indexes[0]}: {exc}") from None
    names = weight_map.values() if isinstance(weight_map, dict) else None
    if not names or not all(isinstance(n, str) and _SHARD_NAME.fullmatch(n) for n in names):
        raise CheckpointError(f"malformed index {indexes[0]}: weight_map must map tensor names "
                              "to *.safetensors file names in the same directory")
    files = [directory / name for name in sorted(set(names))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{indexes[0].name} names missing shard(s): {', '.join(missing)}")
    return files


# safetensors dtype -> (torch dtype name, bytes an element): the header check stays torch-free
_DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "BF16": ("bfloat16", 2),
           "F16": ("float16", 2), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
           "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
           "U8": ("uint8", 1), "BOOL": ("bool", 1)}


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then JSON),
    checked against the file: a truncated file or a tensor past its end is a CheckpointError."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(100_000_000, size - 8):
                raise ValueError(f"header length {length} does not fit the file")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            if stop - start != count * _DTYPES.get(info["dtype"], ("", 0))[1] or start < 0:
                raise ValueError(f"tensor {name} does not match its shape and dtype")
            end = max(end, stop)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    if 8 + length + end > size:
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {size} bytes, "
                              f"its header needs {8 + length + end}")
    return header


def check_files(directory: str | Path, parse: Callable[[dict], object]) -> None:
    """What loading checks before reading any weight, torch-free: config.json through `parse`
    (the model's own config parser, e.g. LMConfig.from_json), every safetensors header and file
    size, and that a sharded index's tensors are in the shards it names."""
    directory = Path(directory)
    parse_config(directory, parse)
    files = weight_files(directory)
    found: dict[str, str] = {}
    for path in files:
        found.update((k, path.name) for k in read_header(path) if k != "__metadata__")
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index and not (directory / SINGLE_FILE).is_file():
        weight_map = json.loads(index[0].read_text(encoding="utf-8"))["weight_map"]
        absent = sorted(k for k, f in weight_map.items() if found.get(k) != f)
        if absent:
            raise CheckpointError(f"{index[0]} names tensor(s) its shards lack: "
                                  f"{_summary(absent, 4)}")


def map_file(path: Path) -> dict:
    """Every tensor of one safetensors file as a view of one private mapping of the whole file
    (`read_header` checked first): building them reads no weight; a tensor's pages are read
    when it is first used. safetensors' own loader touches each tensor as it builds it, and the
    kernel's read-around then reads up to 16 MB about every touch: 3.8 GB of a 5.2 GB
    tokenizer checkpoint whose encoder a synthesis without a voice prompt never uses."""
    import torch

    header = read_header(path)
    try:
        with open(path, "rb") as handle:
            start = 8 + struct.unpack("<Q", handle.read(8))[0]
        storage = torch.UntypedStorage.from_file(str(path), shared=False,
                                                 nbytes=path.stat().st_size)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot map {path}: {exc}") from None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _DTYPES.get(info["dtype"], ("",))[0], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, which "
                                  "this torch cannot hold")
        first, stop = info["data_offsets"]
        raw = torch.empty(0, dtype=torch.uint8, device="cpu")  # "cpu" under any default
        raw.set_(storage, start + first, (stop - first,))
        if (start + first) % dtype.itemsize:  # unaligned (no writer of today's files does it)
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape([int(d) for d in info["shape"]])
    return tensors


def load_tensors(directory: str | Path, device: str = "cpu") -> dict:
    """All tensors of a checkpoint, memory-mapped (`map_file`): nothing is read until used;
    on another `device`, copied there."""
    tensors: dict = {}
    for path in weight_files(directory):
        tensors.update(map_file(path))
    if str(device) != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return tensors


def _summary(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_state_dict(
    expected: dict,
    found: dict,
    where: str,
    ignore: Iterable[str] = (),
) -> dict:
    """Strictly compare checkpoint tensors with a module's state dict; return the usable subset.

    `expected` maps names to tensors (e.g. from `module.state_dict()` on the meta device);
    `ignore` holds regexes of checkpoint tensors that are known and unused (EMA buffers).
    """
    patterns = [re.compile(p) for p in ignore]
    used = {k: v for k, v in found.items() if not any(p.fullmatch(k) for p in patterns)}
    missing = set(expected) - set(used)
    unexpected = set(used) - set(expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_summary(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_summary(unexpected)}")
        raise CheckpointError(f"{where}: " + "; ".join(parts))
    bad = [
        f"{k} {tuple(used[k].shape)} != {tuple(expected[k].shape)}"
        for k in sorted(expected)
        if tuple(used[k].shape) != tuple(expected[k].shape)
    ]
    if bad:
        raise CheckpointError(f"{where}: wrong tensor shape(s): {_summary(bad, 4)}")
    not_float = [k for k in sorted(used) if expected[k].is_floating_point()
                 and not used[k].is_floating_point()]
    if not_float:
        raise CheckpointError(f"{where}: non-float dtype for tensor(s): {_summary(not_float)}")
    return used


def _read_converted(directory: str | Path, names: set[str], expected: dict) -> dict:
    """Read `names` one tensor at a time and convert each to its module dtype.

    Converting memory-mapped tensors would leave every source page resident for as long as the
    mapping lives (it does, through the tensors that need no conversion), so a float32 checkpoint
    loaded as bfloat16 would peak at 1.5x its size; read this way it peaks at the converted size
    plus one source tensor.
    """
    from safetensors import SafetensorError, safe_open

    out = {}
    for path in weight_files(directory):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                wanted = sorted(names.intersection(handle.keys()))
            for name in wanted:  # a mapping per tensor: its pages leave RSS when it closes
                with safe_open(str(path), framework="pt", device="cpu") as handle:
                    out[name] = handle.get_tensor(name).to(expected[name].dtype)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"corrupt or truncated safetensors file {path}: {exc}") from None
    return out


def _read_stacked(directory: str | Path, names: list[str], rows: int, dtype, device) -> object:
    """The tensors `names` (same trailing shape) stacked by rows into one new tensor on
    `device`, each read through its own short-lived mapping: once the stack is built, only the
    stack's pages count, never the source's."""
    import torch
    from safetensors import SafetensorError, safe_open

    located: dict[str, Path] = {}
    for path in weight_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            located.update((k, path) for k in handle.keys() if k in names)
    out, row = None, 0
    for name in names:
        try:
            with safe_open(str(located[name]), framework="pt", device="cpu") as handle:
                part = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(
                f"corrupt or truncated safetensors file {located[name]}: {exc}") from None
        if out is None:
            out = torch.empty((rows, *part.shape[1:]), dtype=dtype, device=device)
        out[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
        del part
    return out


def load_module_weights(module, directory: str | Path, where: str, ignore=(),
                        stacked=(), device="cpu") -> dict:
    """Load a checkpoint into a module built on the meta device (strict, by official names).

    Tensors already in the module's dtype stay memory-mapped (no copy; pages are read on first
    use). The others (e.g. a float32 checkpoint loaded as bfloat16) are read and converted one by
    one, so peak memory stays near the loaded weights' size.

    `stacked` lists groups of tensor names that the module fuses (q/k/v, gate/up): those are
    checked like the rest but not assigned; each group is read straight into one tensor on
    `device` (see `_read_stacked`) and returned by group (a tuple of names), for the module to
    install. Copying them out of the shared mapping instead would keep both copies resident.
    """
    found = load_tensors(directory)  # mapped: nothing is read yet (`map_file`)
    expected = module.state_dict()
    used = check_state_dict(expected, found, where, ignore)
    groups = [tuple(g) for g in stacked]
    skipped = {name for group in groups for name in group}
    convert = {k for k, v in used.items() if v.dtype != expected[k].dtype and k not in skipped}
    if convert:
        used.update(_read_converted(directory, convert, expected))
    stacks = {g: _read_stacked(directory, list(g), sum(used[n].shape[0] for n in g),
                               expected[g[0]].dtype, device) for g in groups}
    missing, unexpected = module.load_state_dict(
        {k: v for k, v in used.items() if k not in skipped}, strict=False, assign=True)
    if set(missing) != skipped or unexpected:
        raise CheckpointError(f"{where}: tensors left unloaded: {_summary(set(missing) ^ skipped)}")
    return stacks
