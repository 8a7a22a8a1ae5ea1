"""Issue 13 "must show": exit 1 (a bug) is reachable from no input, option, file, profile or
environment value. Random argv (text, bytes that are not UTF-8, huge and negative numbers,
NaN and infinities), random `MIMO_*` environment values, random profile files, random bytes
and JSON values as input files and stdin go through the real CLI parser and input readers;
every run must end with a documented exit code other than 1, print no traceback and change
nothing outside its output target.

In-process (Typer's CliRunner): `--dry-run` for the option sweep, the tiny preset with a
2-group cap for the runs that read inputs, so each example takes well under a second. The
examples are fixed (`derandomize`), so CI sees the same cases every time.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from typer.main import get_command
from typer.testing import CliRunner

from mimo_tts import errors
from mimo_tts.batch.items import JSONL_FIELDS, read_items, sanitize_id
from mimo_tts.cli.app import app
from mimo_tts.errors import EXIT_BUG, InputError
from mimo_tts.synthesis.settings import PROFILE_KEYS

DOCUMENTED = {v for k, v in vars(errors).items() if k.startswith("EXIT_")} - {EXIT_BUG}
COMMANDS = get_command(app).commands
# Every MIMO_* variable the package reads, except the cache root (a new one builds the preset).
ENV_KEYS = ("MIMO_AUDIO_TOKENIZER_CUDA_GRAPH", "MIMO_AUDIO_TOKENIZER_DEVICE",
            "MIMO_AUDIO_TOKENIZER_PATH", "MIMO_TTS_AVAILABLE_MEMORY", "MIMO_TTS_CONFIG_DIR",
            "MIMO_TTS_CPU_KERNEL", "MIMO_TTS_DTYPE", "MIMO_TTS_LM_DEVICE",
            "MIMO_TTS_TOKENIZER_DTYPE")
# No shrinking: a failure is reported as drawn (shrinking CLI runs takes minutes).
EXAMPLES = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

# --- values ------------------------------------------------------------------------------------

# What argv can hold: any bytes but NUL, decoded as Python decodes argv (surrogateescape).
ARGV_BYTES = st.binary(max_size=40).filter(lambda b: b"\0" not in b).map(os.fsdecode)
TEXT = st.text(st.characters(exclude_characters="\0"), max_size=40)
NUMBER = st.one_of(
    st.integers(-3, 300), st.integers(), st.sampled_from([2**63, 2**64 - 1, 2**64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["nan", "-inf", "1e999",
                                                                      "0x10", "1_000", " 5"]))
ARG = st.one_of(NUMBER.map(str), TEXT, ARGV_BYTES, st.sampled_from(
    ["", "-", "tiny", "cpu", "cuda", "cuda:7", "mps", "auto", "wav", "flac", "vllm", "native",
     "int8", "official", "tts_sft_with_audio", "float16", "../..", "/dev/null", "/"]))
# JSON values, lone surrogates included (json.dumps writes them as \ud800 escapes).
JSON_TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=30)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=6)
JSON_RECORD = st.dictionaries(st.sampled_from(sorted(JSONL_FIELDS)) | JSON_TEXT, JSON,
                              max_size=5)
LINE = st.one_of(JSON_RECORD.map(json.dumps), JSON.map(json.dumps), TEXT,
                 st.binary(max_size=30).map(lambda b: b.decode("latin-1")))


def _lines(lines: list[str]) -> bytes:
    return "\n".join(lines).encode("utf-8", errors="surrogatepass")


INPUT_BYTES = st.one_of(st.binary(max_size=200), st.lists(LINE, max_size=4).map(_lines))
TOML_VALUE = st.one_of(
    st.integers().map(str), st.floats().map(str),
    st.booleans().map(str).map(str.lower), TEXT.map(json.dumps), ARGV_BYTES.map(json.dumps),
    st.sampled_from(["[1, 2]", "{ a = 1 }", "1979-05-27", "07:32:00", "nan", "-inf", "\"\""]))
PROFILE = st.one_of(
    st.dictionaries(st.sampled_from(sorted(PROFILE_KEYS)) | TEXT, TOML_VALUE, max_size=5).map(
        lambda d: "".join(f"{json.dumps(k)} = {v}\n" for k, v in d.items()).encode(
            "utf-8", errors="surrogatepass")),
    st.binary(max_size=100))
ENV = st.dictionaries(st.sampled_from(ENV_KEYS), ARGV_BYTES | NUMBER.map(str), max_size=3)


def _options(command: str):
    """Random `--option value` / `--flag` words for one command, from its own parameters
    (but `--debug`, which asks for tracebacks)."""
    names = []
    for param in COMMANDS[command].params:
        if param.param_type_name == "option" and param.name != "debug":
            names.extend((opt, param.is_flag) for opt in (*param.opts, *param.secondary_opts))
    word = st.sampled_from(names).flatmap(
        lambda nf: st.just([nf[0]]) if nf[1] else ARG.map(lambda v: [nf[0], v]))
    return st.lists(word, max_size=6).map(lambda words: [w for pair in words for w in pair])


# --- running ------------------------------------------------------------------------------------


@contextmanager
def _sandbox():
    """A fresh empty directory as the working directory of one example."""
    before = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mimo-prop-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(before)


def _tree(root: Path, skip: Path | None = None) -> dict:
    """Every path under `root` (but `skip`) with its kind, size and mtime."""
    out = {}
    for path in root.rglob("*"):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        info = path.lstat()
        out[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return out


def _check(result, root: Path, before: dict, target: Path | None) -> None:
    event(f"exit {result.exit_code}")
    output = result.stdout_bytes.decode(errors="replace") + result.stderr
    assert result.exit_code in DOCUMENTED, output
    assert "Traceback" not in output and "unexpected" not in result.stderr, output
    assert _tree(root, target) == before, "changed outside the output target"


@pytest.fixture
def cli(base_env, monkeypatch, one_thread):
    """cli(args, env=, stdin=) -> Result of the app in-process, with the session's env."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key in ("MIMO_TTS_CACHE", "NO_COLOR", "HF_HUB_OFFLINE", "HF_HOME", "COLUMNS"):
        monkeypatch.setenv(key, base_env[key])
    runner = CliRunner()

    def run(args, env=None, stdin=b""):
        return runner.invoke(app, args, input=stdin, env=env, catch_exceptions=False)

    return run


# --- the properties ------------------------------------------------------------------------------


@settings(EXAMPLES, max_examples=120)
@given(command=st.sampled_from(["synth", "devices"]), data=st.data(), env=ENV,
       profile=st.none() | PROFILE)
def test_random_options_env_and_profiles(cli, command, data, env, profile):
    words = data.draw(_options(command))
    with _sandbox() as root:
        extra = []
        if profile is not None:
            (root / "profile.toml").write_bytes(profile)
            extra = ["--config", "profile.toml"]
        if command == "synth":
            extra += ["--dry-run", "--text", "Hello."]
        before = _tree(root)
        result = cli([command, "--model", "tiny", *extra, *words], env=env)
        _check(result, root, before, None)  # a dry run and `devices` write nothing


SAMPLER = st.lists(st.one_of(
    st.tuples(st.sampled_from(["--temperature", "--audio-temperature"]),
              st.floats(0, 100) | st.sampled_from([1e-300, 5e-324, 1e-40, 100.0])),
    st.tuples(st.sampled_from(["--top-p", "--audio-top-p"]), st.floats(1e-320, 1.0)),
    st.tuples(st.sampled_from(["--top-k", "--audio-top-k"]), st.integers(0, 10**30)),
    st.tuples(st.just("--seed"), st.integers(0, 2**64 - 1))), max_size=3).map(
        lambda pairs: [str(w) for pair in pairs for w in pair])


@settings(EXAMPLES, max_examples=16)
@given(content=INPUT_BYTES, suffix=st.sampled_from([".txt", ".jsonl", ".JSONL", ""]),
       stdin=INPUT_BYTES, how=st.sampled_from(["file", "stdin", "text-stdin"]),
       sampler=SAMPLER, words=st.just([]) | _options("synth").filter(
           lambda w: len(w) <= 2 and not {"-o", "--output", "--output-dir", "--raw",
                                          "--engine"} & set(w)))
def test_random_inputs_through_a_real_run(cli, content, suffix, stdin, how, sampler, words):
    words = sampler + words
    with _sandbox() as root:
        (root / f"items{suffix}").write_bytes(content)
        source = {"file": ["--input", f"items{suffix}"], "stdin": ["--input", "-"],
                  "text-stdin": ["--text", "-"]}[how]
        before = _tree(root)
        result = cli(["synth", "--model", "tiny", *words, *source, "--text", "A good item.",
                      "--max-new-groups", "2", "--output-dir", "out"],
                     env={"MIMO_TTS_CPU_KERNEL": "0"}, stdin=stdin)
        _check(result, root, before, root / "out")


@settings(EXAMPLES, max_examples=150)
@given(content=INPUT_BYTES, suffix=st.sampled_from([".txt", ".jsonl"]), texts=st.lists(
    JSON_TEXT, max_size=3), stdin=INPUT_BYTES)
def test_input_readers_fail_items_never_the_run(content, suffix, texts, stdin, tmp_path):
    import io

    path = tmp_path / f"items{suffix}"
    path.write_bytes(content)
    try:
        items = read_items(texts, [str(path), "-"], io.TextIOWrapper(io.BytesIO(stdin)))
    except InputError as exc:  # only a whole source that cannot be read
        assert "stdin" in str(exc) or str(path) in str(exc)
        return
    for item in items:
        assert item.error is None or isinstance(item.error, InputError)
        assert item.id == sanitize_id(item.id) and item.id
        if item.error is None:
            assert item.text.strip() and item.text.encode("utf-8")


@settings(EXAMPLES, max_examples=30)
@given(files=st.lists(st.binary(max_size=300), min_size=1, max_size=3), words=_options(
    "decode").filter(lambda w: not {"-o", "--output"} & set(w)))
def test_random_codes_files_through_decode(cli, files, words):
    with _sandbox() as root:
        names = []
        for n, data in enumerate(files):
            names.append(f"c{n}.codes.safetensors")
            (root / names[-1]).write_bytes(data)
        before = _tree(root)
        result = cli(["decode", *names, *words], env={"MIMO_TTS_CPU_KERNEL": "0"})
        _check(result, root, before, None)  # random bytes never decode: nothing written
