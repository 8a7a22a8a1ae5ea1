"""Issue 12: a wrong-typed option is `OptionTypeError` (a UsageError, exit 2, and a TypeError)
naming the field, raised where the option groups are built; never torch's, tokenizers' or
Python's own error from deep in a run (`manual_seed expected a long`, `'<=' not supported`)."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import get_args, get_type_hints

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mimo_tts.errors import EXIT_USAGE, OptionTypeError, UsageError
from mimo_tts.synthesis import options as mopts
from mimo_tts.synthesis.options import EngineOptions, RunOptions, SynthesisOptions
from mimo_tts.synthesis.settings import OptionValues, resolve

GROUPS = (SynthesisOptions, EngineOptions, RunOptions, OptionValues)
FIELDS = [(cls, f.name) for cls in GROUPS for f in fields(cls)]
# Values of every kind an option might be handed by mistake.
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
    st.binary(max_size=8), st.complex_numbers(), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.tuples(st.integers(), st.text(max_size=3)), st.sampled_from([object(), np.bool_(True),
                                                                      Path("x"), b"x"]))


def _fits(cls, name: str, value) -> bool:
    """Whether `value` has the type the field's annotation names (an independent reading)."""
    kinds = get_args(get_type_hints(cls)[name]) or (get_type_hints(cls)[name],)
    if value is None:
        return type(None) in kinds
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, int):
        return int in kinds or float in kinds
    if isinstance(value, float):
        return float in kinds
    if isinstance(value, os.PathLike):
        return name in mopts.PATH_FIELDS
    return str in kinds and isinstance(value, str)


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(FIELDS), ANY)
def test_a_wrong_typed_value_is_the_typed_error_naming_the_field(field, value):
    cls, name = field
    if _fits(cls, name, value):
        return
    with pytest.raises(OptionTypeError) as refused:
        cls(**{name: value})
    assert str(refused.value).startswith(name), refused.value
    assert isinstance(refused.value, UsageError) and isinstance(refused.value, TypeError)
    assert refused.value.exit_code == EXIT_USAGE


@pytest.mark.parametrize(("given", "name"), [
    ({"seed": "3"}, "seed"), ({"seed": 1.5}, "seed"), ({"temperature": "0.5"}, "temperature"),
    ({"max_chars": True}, "max_chars"), ({"top_k": 2.0}, "top_k"),
    ({"lm_threads": "2"}, "lm_threads"), ({"no_memory_check": 1}, "no_memory_check"),
    ({"batch_size": True}, "batch_size"), ({"cuda_graph": "yes"}, "cuda_graph"),
    ({"lm_device": 0}, "lm_device"),
])
def test_resolve_keeps_the_typed_error(given, name):
    """The library and the server resolve a mapping: the same typed error, not the generic
    `bad option value: ...` the profile path wraps other TypeErrors in."""
    with pytest.raises(OptionTypeError, match=f"^{name} must be"):
        resolve(given, env={})


def test_numbers_are_normalised_and_bools_are_not_numbers():
    o = SynthesisOptions(seed=np.int64(7), temperature=1, top_p=np.float32(0.5))
    assert (type(o.seed), type(o.temperature), type(o.top_p)) == (int, float, float)
    assert o == SynthesisOptions(seed=7, temperature=1.0, top_p=0.5)
    with pytest.raises(UsageError, match="temperature must be in"):  # 10**400: no float
        SynthesisOptions(temperature=10**400)
    assert RunOptions(output_dir=Path("out")).output_dir == "out"
    for bad in (True, np.bool_(False)):
        with pytest.raises(OptionTypeError, match="^seed must be an integer"):
            SynthesisOptions(seed=bad)
