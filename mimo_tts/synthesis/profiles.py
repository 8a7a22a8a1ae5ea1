"""Run profiles: TOML files whose keys are the options' fields, from the user folder, then
the packaged configs."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from mimo_tts.errors import UsageError, short_repr
from mimo_tts.synthesis.settings import PROFILE_KEYS, PROFILE_TYPES


def _builtin_dir() -> Path:
    """The built-in profiles: `mimo_tts.configs` of an install (the repository's top-level
    `configs/`, mapped into the package), else that folder of a source checkout."""
    try:
        return Path(str(resources.files("mimo_tts.configs")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "configs"


PROFILE_DIR = _builtin_dir()

USER_PROFILE_ENV = "MIMO_TTS_CONFIG_DIR"  # a folder of the user's own profiles


def profile_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where named profiles are looked up: the user's folder first, then the built-in ones."""
    env = os.environ if env is None else env
    base = env.get(USER_PROFILE_ENV) or str(
        Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "mimo-tts")
    return [Path(base).expanduser(), PROFILE_DIR]


class Profile(dict):
    """A loaded profile's values, and the file they came from (its errors name it)."""

    def __init__(self, values: Mapping[str, object], path: Path):
        super().__init__(values)
        self.path = path


def load_profile(name: str | None, env: Mapping[str, str] | None = None) -> dict:
    """A TOML profile: a path, or a name in the user's config folder or the built-in profiles.

    Every key must be an option's, with a value of that option's type (ranges are checked with
    the flags, `resolve_options`); an error names the file and the key."""
    if not name:
        return {}
    path = Path(name).expanduser()
    if not path.is_file():
        path = next((d / f"{name}.toml" for d in profile_dirs(env)
                     if (d / f"{name}.toml").is_file()), path)
    if not path.is_file():
        raise UsageError(f"config profile not found: {name}")
    try:
        profile = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"invalid TOML in {path}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read config profile {path}: {exc.strerror or exc}") from None
    unknown = sorted(set(profile) - PROFILE_KEYS)
    if unknown:
        raise UsageError(f"{path}: unknown key(s) {', '.join(map(_suggest, unknown))}")
    for key, value in profile.items():
        kind = PROFILE_TYPES[key]
        if not _is_a(value, kind):
            raise UsageError(f"{path}: {key} must be {_TYPE_NAMES[kind]}, got {_toml_kind(value)}")
    return Profile(profile, path)


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_a(value: object, kind: type) -> bool:
    if isinstance(value, bool):  # TOML's true/false are ints to Python
        return kind is bool
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _toml_kind(value: object) -> str:
    """A TOML value as an error shows it: `a string 'no'`, `an array`, `a date`."""
    scalars = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    if type(value) in scalars:
        return f"{scalars[type(value)]} {short_repr(value)}"
    return {list: "an array", dict: "a table"}.get(type(value), f"a {type(value).__name__}")


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, PROFILE_KEYS, n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key
