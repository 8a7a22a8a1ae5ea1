"""Files and processes: the cache root, temp files renamed into place (atomic writes: the
package's one recipe, `atomic_write`, or its parts `temp_beside`, `create_temp` and `publish`
for files written piecemeal or by another program), no-follow opens, live pids."""

from __future__ import annotations

import contextlib
import errno
import filecmp
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from mimo_tts.errors import OutputError

TEMP_MARK = ".mimo-tmp-"


def temp_beside(path: Path) -> Path:
    """A hidden `.part` file beside `path`, named by this pid: never matched by `*.wav`-style
    globs, and known as a dead run's leftover once the pid is gone (`clean_temp_files`)."""
    return path.with_name(f"{TEMP_MARK}{os.getpid()}-{path.name}.part")


def is_special_file(path: str | Path) -> bool:
    """True for an existing target that is not a regular file or directory (device, FIFO)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def publish(temp: Path, path: Path, keep_same: bool = False) -> None:
    """Rename the finished `temp` over `path` in one step, so a reader sees the old file or the
    new, never half; with `keep_same` a file `path` that holds the same bytes stays as it is
    (its mtime too) and `temp` goes."""
    if keep_same and path.is_file() and filecmp.cmp(temp, path, shallow=False):
        temp.unlink()
    else:
        os.replace(temp, path)


def atomic_write(path: str | Path, writer, keep_same: bool = False) -> Path:
    """Write through `writer(file)` into a temp file beside `path`, fsync, then rename
    (`publish`); a device or FIFO at `path` is written in place."""
    path = Path(path)
    if is_special_file(path):
        return _write_in_place(path, writer)
    temp = temp_beside(path)
    try:
        with create_temp(temp) as handle:
            writer(handle)
            handle.flush()
            os.fsync(handle.fileno())
        publish(temp, path, keep_same)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:  # Ctrl-C or a failing writer: no partial file stays behind
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return path


def create_temp(temp: Path):
    """A new temp file, never through a link: a file of that name (a reused pid's leftover, or
    a planted symlink) is removed first, and O_EXCL | O_NOFOLLOW refuse one that reappears."""
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(temp, flags, 0o666), "wb")


def open_no_follow(path: Path, flags: int):
    """A binary file object on `path` opened with O_NOFOLLOW (O_CREAT: mode 0o666 - umask);
    a symbolic link there is an OutputError, so nothing outside the output folder changes."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; remove it (mimo-tts never writes "
                              "through links in its output folder)") from None
        raise
    return os.fdopen(fd, "r+b" if flags & os.O_RDWR else "ab" if flags & os.O_APPEND else "wb")


def _write_in_place(path: Path, writer) -> Path:
    try:
        with open(path, "wb") as handle:
            writer(handle)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def write_json(path: str | Path, data: dict) -> Path:
    payload = (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
    return atomic_write(path, lambda f: f.write(payload))


def clean_temp_files(directory: str | Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Remove temp files left by killed runs: all of them (holding the directory lock), or
    with `names` only those for these target names whose writer's pid is dead (no lock)."""
    removed = []
    for path in Path(directory).glob(f"{TEMP_MARK}*"):
        if names is not None:
            pid, _, rest = path.name[len(TEMP_MARK):].partition("-")
            if rest.removesuffix(".part") not in names or not pid.isdigit() or pid_alive(int(pid)):
                continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (ours, or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def remove_quietly(*paths: Path | None) -> None:
    """Best-effort removal (cleaning up an item's files after it failed half-way)."""
    for path in paths:
        if path is not None and not is_special_file(path):
            with contextlib.suppress(OSError):
                Path(path).unlink()


CACHE_ENV = "MIMO_TTS_CACHE"


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mimo-tts"
