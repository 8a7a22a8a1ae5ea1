"""A run's options resolved once: the `OptionValues` a caller gives (the CLI's commands build
them from their flags; the library and the server give a mapping of option names) -> `Settings`,
flag > env > profile > default for every value, with its source. The option groups themselves
(`SynthesisOptions`, `EngineOptions`, `RunOptions`), each checking its values, are in
`options.py`; devices and checkpoint names are resolved here in the same pass. No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import get_args, get_type_hints

from mimo_tts.errors import CheckpointError, MimoTTSError, OptionTypeError, UsageError, short_repr
from mimo_tts.lm.config import quant_refusal
from mimo_tts.presets import TINY, checkpoint_dtype
from mimo_tts.runtime.checkpoints import DEFAULT_MODEL, DEFAULT_TOKENIZER, TOKENIZER_PATH_ENV
from mimo_tts.runtime.devices import Placement, resolve_placement
from mimo_tts.synthesis.audio import output_format
from mimo_tts.synthesis.options import (
    PLACEMENT_FIELDS,
    CheckpointNames,
    EngineOptions,
    RunOptions,
    SynthesisOptions,
    check,
    check_types,
    task_for,
)

# Built in this order, so the first of several bad values is reported as before the split.
GROUPS = {"run": RunOptions, "synthesis": SynthesisOptions, "engine": EngineOptions}


def value_type(hint) -> type:
    """The type an option field holds when set (`int | None` -> int; a union's first type)."""
    return next(t for t in get_args(hint) or (hint,) if t is not type(None))


# The options no group holds, each with its value type: the placement's (in
# `resolve_placement`'s order) and the checkpoints'.
UNGROUPED = {**dict.fromkeys(PLACEMENT_FIELDS, str), "cuda_graph": bool, "model": str,
             "tokenizer": str, "allow_download": bool}


def _option_fields() -> list[tuple[str, object, object]]:
    """Every option group's fields, then the ungrouped options: each `T | None`, None."""
    named = [(f.name, value_type(get_type_hints(cls)[f.name]))
             for cls in (SynthesisOptions, EngineOptions, RunOptions) for f in fields(cls)]
    return [(name, kind | None, field(default=None))
            for name, kind in [*named, *UNGROUPED.items()]]


class _OptionValues:
    """The options a caller gives, by name (None: not given, so env, profile or default
    decide): what the CLI's commands build from their flags and `resolve` reads. Its fields are
    made from the groups: each field of `SynthesisOptions`, `EngineOptions` and `RunOptions`,
    then `UNGROUPED`'s, each of that field's value type or None."""

    def __post_init__(self):
        check_types(self)

    @classmethod
    def of(cls, values: OptionValues | Mapping[str, object]) -> OptionValues:
        """Option values from a mapping of option names (the library's and the server's)."""
        if isinstance(values, OptionValues):
            return values
        unknown = sorted(set(values) - OPTION_NAMES)
        check(not unknown, f"unknown option(s) {', '.join(map(repr, unknown))}")
        return cls(**values)

    def given(self) -> dict[str, object]:
        """The options that were given, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


OptionValues = make_dataclass("OptionValues", _option_fields(), bases=(_OptionValues,),
                              frozen=True, namespace={"__module__": __name__,
                                                      "__doc__": _OptionValues.__doc__})
OPTION_NAMES = frozenset(f.name for f in fields(OptionValues))
# Profile key -> the type its value must have (an option field's own annotation).
PROFILE_TYPES = {f.name: value_type(f.type) for f in fields(OptionValues)}
PROFILE_KEYS = frozenset(PROFILE_TYPES)


@dataclass(frozen=True)
class Settings:
    """Every option of a run, resolved once; `sources[name]` says where each value came from."""

    synthesis: SynthesisOptions = field(default_factory=SynthesisOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    run: RunOptions = field(default_factory=RunOptions)
    placement: Placement | None = None
    checkpoints: CheckpointNames | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes) -> Settings:
        """A copy with some option fields changed (each group validates again)."""
        groups = {name: getattr(self, name) for name in GROUPS}
        for key, value in changes.items():
            group = next((g for g, cls in GROUPS.items()
                          if key in {f.name for f in fields(cls)}), None)
            check(group is not None, f"unknown option {key!r}")
            groups[group] = replace(groups[group], **{key: value})
        groups["run"].check_combinations()
        return replace(self, **groups)


def resolve(given: OptionValues | Mapping[str, object],
            profile: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
            probe=None) -> Settings:
    """given > env > profile > default for every option, in one pass (usage errors raised).

    `given`: `OptionValues`, or a mapping of option names (`mimo_tts.load`, the server)."""
    given = OptionValues.of(given)
    return place(resolve_options(given, profile), given, profile, env, probe)


def resolve_options(given: OptionValues | Mapping[str, object],
                    profile: Mapping[str, object] | None = None) -> Settings:
    """The option groups alone (given > profile > default); no placement or checkpoints yet."""
    given = OptionValues.of(given)
    profile = profile or {}
    sources: dict[str, str] = {}
    groups = {}
    try:
        for name, cls in GROUPS.items():
            values = {}
            for spec in fields(cls):
                value, source = _pick(spec.name, given, profile)
                if value is not None:
                    values[spec.name] = value
                sources[spec.name] = source
            if cls is SynthesisOptions and "task" not in values:  # no --task: the inputs say
                values["task"] = task_for(values.get("instruct"), values.get("prompt_audio"),
                                          values.get("voice"))
            if cls is SynthesisOptions and groups["run"].caption_formats and not values.get(
                    "captions"):  # caption files need a cue per sentence
                values["captions"] = True
            groups[name] = _build(cls, values, [k for k in values if sources[k] == "config"],
                                  profile)
    except OptionTypeError:
        raise
    except TypeError as exc:
        raise UsageError(f"bad option value: {exc}") from None
    run = groups["run"]
    if run.output is not None:  # `-o x.flac` writes FLAC; a --format that disagrees is refused
        given = run.format if sources["format"] != "default" else None
        groups["run"] = replace(run, format=output_format(run.output, given))
    groups["run"].check_combinations()
    return Settings(**groups, sources=sources)


def place(settings: Settings, given: OptionValues,
          profile: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None,
          probe=None) -> Settings:
    """Add the devices (flag > env > profile > default, `devices.py`) and the checkpoint names
    (`checkpoints.pick_names`) to option groups from `resolve_options`."""
    profile = profile or {}
    env = os.environ if env is None else env
    sources = dict(settings.sources)
    try:
        lm, tok = pick_names(given.model, given.tokenizer, profile, env)
        error = None
    except MimoTTSError as exc:  # raised after the placement's own errors, as before
        lm = tok = None
        error = exc
    # `--dtype auto` follows the checkpoints' own torch_dtype (config.json)
    dtypes = (None, None) if error else (checkpoint_dtype(*lm, "model", env),
                                         checkpoint_dtype(*tok, "tokenizer", env))
    placement = resolve_placement(*(getattr(given, name) for name in PLACEMENT_FIELDS),
                                  profile=profile, env=env, probe=probe,
                                  checkpoint_dtypes=dtypes)
    if error:
        raise error
    quant = settings.engine.lm_quant
    why = quant_refusal(quant, placement.lm_device.value, placement.lm_dtype.value,
                        placement.cpu_kernel.value)
    if why:
        raise UsageError(f"--lm-quant {quant} {why}")
    sources.update({name: choice.source for name, choice in vars(placement).items()})
    download, sources["allow_download"] = _pick("allow_download", given, profile)
    sources.update({"model": lm[1], "tokenizer": tok[1]})
    return replace(settings, placement=placement,
                   checkpoints=CheckpointNames(lm, tok, bool(download)), sources=sources)


def pick_names(model: str | None, tokenizer: str | None, profile: Mapping | None = None,
               env: Mapping[str, str] | None = None) -> tuple[tuple[str, str], tuple[str, str]]:
    """(name, source) for the LM and the tokenizer: flag > env > profile > default (the tiny
    preset's LM comes with the tiny preset's tokenizer)."""
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


def _build(cls, values: dict, from_profile: list[str], profile: Mapping):
    """`cls(**values)`; an error that one profile value alone causes names its file and key."""
    try:
        return cls(**values)
    except UsageError as exc:
        for key in from_profile:
            try:
                cls(**{k: v for k, v in values.items() if k != key})
            except UsageError:
                continue
            raise UsageError(f"{getattr(profile, 'path', 'config profile')}: {key} = "
                             f"{short_repr(values[key])}: {exc}") from None
        raise


def _pick(name: str, given: OptionValues, profile: Mapping) -> tuple[object, str]:
    if getattr(given, name) is not None:
        return getattr(given, name), "flag"
    if profile.get(name) is not None:
        return profile[name], "config"
    return None, "default"
