"""Issue 30 item 4: each option is declared once, in `cli/params.CATALOGUE`, with the commands
that take it. Every command's flags, `OptionValues`, the servers' `ServeConfig` and
`scripts/ray_synth.py`'s parser come from it; a new entry reaches exactly its commands."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Annotated

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from mimo_tts.cli import book, params, synth
from mimo_tts.cli.app import app
from mimo_tts.cli.params import CATALOGUE, OPTIONS, SERVER, Option, options_of, takes
from mimo_tts.server import protocol
from mimo_tts.server.protocol import SERVE_KEYS, WYOMING_PORT, ServeConfig
from mimo_tts.synthesis.options import RunOptions
from mimo_tts.synthesis.settings import PROFILE_TYPES, OptionValues
from tests.helpers import REPO

GROUP = get_command(app)
COMMANDS = {"voices-add" if name == "voices" else name: (
    GROUP.commands[name].commands["add"] if name == "voices" else GROUP.commands[name])
    for name in GROUP.commands}
# Each command's flags by help panel, as `--help` listed them before the catalogue (at 5cc00c0).
# book's Outputs and Inputs panels keep their flags; their order is now the catalogue's.
MODEL = {"Models": "--model -m --tokenizer --allow-download --offline",
         "Devices": "--lm-device --tokenizer-device --dtype --tokenizer-dtype --cuda-graph "
                    "--no-cuda-graph --no-memory-check --lm-quant --lm-threads --tokenizer-threads",
         "Generation": "--seed --speed --sentence-silence --temperature --top-k --top-p "
                       "--audio-temperature --audio-top-k --audio-top-p --max-new-groups "
                       "--batch-size",
         "vLLM engine": "--engine --gpu-memory-utilization --max-num-seqs --tensor-parallel-size "
                        "--max-model-len"}
SERVED = {"Generation": "--max-new-groups --speed --sentence-silence",
          "Models": "--model -m --tokenizer",
          "Devices": "--lm-device --tokenizer-device --dtype --tokenizer-dtype --cuda-graph "
                     "--no-cuda-graph --no-memory-check --lm-quant --lm-threads "
                     "--tokenizer-threads",  # --lm-quant: since issue 31's w8a8
          "Run": "--config -c --verbose -v --debug"}
BEFORE = {
    "synth": {
        "Inputs": "--text -t --input -i --task --instruct --prompt-audio --voice --template "
                  "--max-chars",
        "Outputs": "--captions --output-dir --output -o --format --sample-rate --save-codes "
                   "--overwrite --stream --raw --stream-mode",
        **MODEL, "Run": "--config -c --shard --dry-run --json --quiet -q --verbose -v --debug"},
    "book": {
        "Outputs": "--output-dir --format --no-m4b --overwrite",
        "Book": "--list --chapters --title --author --items-out",
        "Inputs": "--voice --prompt-audio --instruct --voice-per-piece",  # (the last: since)
        **MODEL, "Run": "--config -c --shard --json --quiet -q --verbose -v --debug"},
    "devices": {
        "Models": "--model -m --tokenizer",
        "Devices": "--lm-device --tokenizer-device --dtype --tokenizer-dtype --cuda-graph "
                   "--no-cuda-graph --no-memory-check",
        "vLLM engine": "--engine", "Run": "--config -c --json --debug"},
    "decode": {
        "Models": "--tokenizer",
        "Devices": "--tokenizer-device --tokenizer-dtype --cuda-graph --no-cuda-graph "
                   "--no-memory-check",
        "Outputs": "--output -o --format --sample-rate --overwrite", "Run": "--quiet -q --debug"},
    "selftest": {"Devices": "--lm-device --tokenizer-device", None: "--json",
                 "Run": "--debug"},
    "serve": {"Server": "--host --port --api-key --allowed-host --voice --batch-size "
                        "--max-concurrent --max-queue --max-input-chars --timeout "
                        "--stage1-batch", **SERVED,
              "Run": "--config -c --quiet -q --verbose -v --debug"},  # -q: issue 33's log
    "wyoming": {"Server": "--host --port --voice --batch-size --max-concurrent --max-queue "
                          "--max-input-chars --timeout --uri", **SERVED},
    "voices-add": {None: "--transcript --overwrite", "Models": "--model -m --tokenizer",
                   "Devices": "--tokenizer-device --tokenizer-dtype",
                   "Run": "--json --verbose -v --debug"},
}


def _flags(command) -> dict:
    """A command's flags by panel, in order (panels in the order --help shows them)."""
    panels: dict = {}
    for param in command.params:
        if param.opts[0].startswith("-"):
            panels.setdefault(param.rich_help_panel, []).extend(param.opts
                                                                 + param.secondary_opts)
    return panels


def _ray():
    spec = importlib.util.spec_from_file_location("ray_synth", REPO / "scripts" / "ray_synth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines its functions; runs nothing
    return module


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_command_lists_the_flags_it_listed_before(name):
    """The same flags in the same panels (and every panel where it was) as before."""
    panels = _flags(COMMANDS[name])
    assert list(panels) == list(BEFORE[name]) or name == "book", list(panels)
    assert {k: sorted(v) for k, v in panels.items()} == \
        {k: sorted(v.split()) for k, v in BEFORE[name].items()}
    if name != "book":  # (the catalogue's order is synth's)
        assert {k: v for k, v in panels.items()} == \
            {k: v.split() for k, v in BEFORE[name].items()}


def test_synth_and_book_share_what_they_shared_before_from_one_declaration():
    """The flags both listed before are the catalogue's options of both (each one entry), plus
    --output-dir and --format (each command's own words) and how they report."""
    def flags(name):
        return {f for panel in BEFORE[name].values() for f in panel.split()}

    both = {f for o in CATALOGUE if {"synth", "book"} <= set(o.commands)
            for flag in o.flags for f in flag.split("/")}
    assert len(both) == 38  # 34 options, with -m, -c, --offline, --no-cuda-graph
    assert flags("synth") & flags("book") == both | {
        "--output-dir", "--format", "--json", "--quiet", "-q", "--verbose", "-v", "--debug"}
    for name in ("synth", "book"):
        assert flags(name) == {f for p in _flags(COMMANDS[name]).values() for f in p}


@pytest.mark.parametrize("option", CATALOGUE, ids=lambda o: f"{o.name}:{'+'.join(o.commands)}")
def test_every_option_reaches_each_command_that_lists_it_and_no_other(option):
    for name, command in COMMANDS.items():
        shown = [p for p in command.params if p.name == option.name]
        if name in option.commands:
            (param,) = shown
            assert param.opts + param.secondary_opts == [
                f for flag in option.flags for f in flag.split("/")]
            assert (param.help, param.metavar, param.rich_help_panel) == (
                option.help_for(name), option.metavar, option.panel)
        else:
            assert not any(p.help == option.help_for(c) for p in shown
                           for c in option.commands), (name, option.name)
    known = {*COMMANDS, "ray_synth"}
    assert set(option.commands) <= known, set(option.commands) - known


def test_each_option_has_one_home_of_its_type():
    names = {}
    for option in CATALOGUE:
        for command in option.commands:
            assert (command, option.name) not in names, (command, option.name)
            names[command, option.name] = option
        if option.home == OPTIONS:
            assert option.kind is PROFILE_TYPES[option.name]
        elif option.home == SERVER:
            assert option.name in SERVE_KEYS
        else:  # the command's own: each command that takes it names it
            assert option.kind in (str, bool)
    # every server option a server takes, and nothing else there
    assert {o.name for o in options_of("serve") if o.home == SERVER} == set(SERVE_KEYS)


def test_defaults_and_env_variables_are_shown_from_their_homes():
    shown = {(o.name, c): o.help_for(c) for o in CATALOGUE for c in o.commands}
    assert f"(default {ServeConfig.batch_size})" in shown["batch_size", "serve"]
    assert f"(default {ServeConfig.timeout:g})" in shown["timeout", "wyoming"]
    assert f"(default {WYOMING_PORT})" in shown["port", "wyoming"]
    assert f"(default {RunOptions.sample_rate})" in shown["sample_rate", "synth"]
    assert shown["max_queue", "serve"].startswith("Requests waiting")
    assert shown["max_queue", "wyoming"].startswith("Texts waiting")
    for option in CATALOGUE:
        for command in option.commands:
            text = shown[option.name, command]
            assert "{" not in text and (option.env is None or option.env in text)
            assert all(choice in text for choice in option.choices)


def test_a_new_option_is_one_entry_and_reaches_exactly_its_commands(monkeypatch):
    """As issue 33's --speed will: one entry (here an option no flag gave before) appears on
    the commands it names, arrives in `OptionValues` by name, and nowhere else."""
    entry = Option("kv_cache_mib", "synth probe ray_synth", "KV cache size (default {default}).",
                   "MIB", params.VLLM, default=64)
    monkeypatch.setattr(params, "CATALOGUE", (*CATALOGUE, entry))
    seen = []

    def probe(*, options: OptionValues, serving: dict) -> None:
        seen.append(options)

    probe_app = typer.Typer()
    for name, fn in (("probe", probe), ("synth", synth.synth.__wrapped__),
                     ("book", book.book.__wrapped__)):
        probe_app.command(name)(takes(name)(fn))
    commands = get_command(probe_app).commands
    assert "--kv-cache-mib" in _flags(commands["synth"])["vLLM engine"]
    assert all("--kv-cache-mib" not in flags for flags in _flags(commands["book"]).values())
    assert _flags(commands["probe"]) == {"vLLM engine": ["--kv-cache-mib"]}
    result = CliRunner().invoke(probe_app, ["probe", "--kv-cache-mib", "32"])
    assert result.exit_code == 0, result.output
    assert seen == [OptionValues(kv_cache_mib=32)]
    args = _ray().parser().parse_args(["x.txt", "--kv-cache-mib", "16"])
    assert _ray().request(args).options.kv_cache_mib == 16


def test_a_flag_declared_twice_is_refused():
    def twice(seed: Annotated[int | None, typer.Option()] = None, *,
              options: OptionValues) -> None:
        pass

    with pytest.raises(TypeError, match="--seed is the catalogue's"):
        takes("synth")(twice)
    with pytest.raises(TypeError, match="nowhere takes"):
        takes("synth")(lambda *, config, shard: None)


def test_ray_synth_takes_synths_flags_to_the_same_options():
    """The script's parser has synth's spellings, and the same argv gives the same
    `OptionValues` there as through synth's own signature."""
    ray = _ray()
    parser = ray.parser()
    synth_flags = {f for p in _flags(COMMANDS["synth"]).values() for f in p}
    for option in options_of("ray_synth"):
        assert "synth" in option.commands
        (action,) = [a for a in parser._actions if a.dest == option.name]
        assert set(action.option_strings) == set(option.flags) <= synth_flags
    argv = ["--task", "tts_sft_with_instruct", "--instruct", "calm", "-m", "tiny", "--seed", "7",
            "--batch-size", "2", "--format", "flac", "--save-codes", "--overwrite",
            "--engine", "native", "--tokenizer-dtype", "float32", "-c", "ci-smoke"]
    seen = []

    def probe(*, options: OptionValues, config: str | None, shard: str | None) -> None:
        seen.append((options, config))

    probe_app = typer.Typer()
    probe_app.command("synth")(takes("synth")(probe))
    probe_app.command("other")(lambda: None)
    result = CliRunner().invoke(probe_app, ["synth", *argv])
    assert result.exit_code == 0, result.output
    request = ray.request(parser.parse_args(["in.txt", *argv]))
    options, config = seen[0]
    # the script keeps its explicit --output-dir default (a flag over a profile's, as before)
    assert request.options == OptionValues(**{**options.given(),
                                              "output_dir": RunOptions.output_dir})
    assert request.config == config == "ci-smoke"


@pytest.mark.parametrize(("command", "environ", "port"), [
    ("serve", {"MIMO_TTS_API_KEY": "k"}, ServeConfig.port),
    ("wyoming", {"MIMO_TTS_API_KEY": "k"}, WYOMING_PORT),
])
def test_servers_get_a_serve_config_and_option_values(monkeypatch, tmp_path, command, environ,
                                                      port):
    """`run_server(module, ServeConfig, OptionValues)`: the server's own options typed, the
    model's apart (before: one dict of both, split again by name in `lifecycle.loaded`)."""
    module = importlib.import_module({"serve": "mimo_tts.server.app",
                                      "wyoming": "mimo_tts.server.wyoming"}[command])
    calls = []
    monkeypatch.setattr(module, "require_extra", lambda: calls.append("extra"))
    monkeypatch.setattr(module, "main", lambda cfg, options, config, reporter: calls.append(
        (cfg, options, config)) or 0)
    voice = tmp_path / "me.wav"
    voice.write_bytes(b"")
    result = CliRunner().invoke(app, [command, "--voice", f"me={voice}", "--batch-size", "3",
                                      "--max-new-groups", "5", "--lm-threads", "2", "-c", "p"],
                                env=environ)
    assert result.exit_code == 0, result.output
    extra, (cfg, options, config) = calls
    key = "k" if command == "serve" else None  # Wyoming has no key
    assert cfg == ServeConfig(port=port, batch_size=3, voices={"me": str(voice)}, api_key=key)
    assert options == OptionValues(max_new_groups=5, lm_threads=2) and config == "p"


def test_serve_config_takes_the_catalogues_names():
    assert protocol.serve_config({"voice_files": None, "port": 9, "host": None}, {}) == \
        ServeConfig(port=9)
    with pytest.raises(TypeError):
        protocol.serve_config({"voice": ["a=b"]}, {})  # the old name is no server option
