"""`mimo-tts`: the command line (Typer + rich). Thin: parse -> options -> batch runner -> report.

One module per command (`synth.py`: synth, devices; `book.py`; `decode.py`; `tools.py`: status,
download, selftest, serve; `wyoming.py`), every option once in `params.py` (the catalogue each
command's signature is built from), messages and exit codes in `report.py`; this module is the
app: the group, its parse-error handling, the registration and `main`. torch is never imported
at import: the command bodies import what they need, and `--help`, `devices`, `status`,
`synth --dry-run` and `book --list` never import it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from mimo_tts._version import __version__
from mimo_tts.batch.files import _broken_pipe
from mimo_tts.cli import book, decode, synth, tools, voices, wyoming
from mimo_tts.cli.params import EXAMPLES
from mimo_tts.cli.report import Reporter
from mimo_tts.errors import EXIT_OK, EXIT_USAGE


def _plain_metavars(params: list) -> list:
    """A flag takes no value: no `<bool>` beside it (`--help` included); an argument shows its
    metavar alone, without `<list[str]>` (Typer's options already do)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar:
            param.display_type_rich = lambda ctx: None
    return params


class Command(TyperCommand):
    """Every mimo-tts command: plain metavars in the help and the usage line."""

    def get_params(self, ctx):
        return _plain_metavars(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        # Typer writes a required argument as `{CODES}...`; the usual form is `CODES...`
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


class App(TyperGroup):
    """The mimo-tts group: plain metavars in the help; parse errors as one line off a terminal."""

    def get_params(self, ctx):
        return _plain_metavars(super().get_params(ctx))

    def make_context(self, *args, **kwargs):
        with _parse_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):  # a command's own parse runs in here
        with _parse_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _parse_errors():
    """Typer's usage errors (exit 2) as one `Error:` line naming the help command when stderr
    is not a terminal, so a CI log's last line says what went wrong; a terminal gets the box.
    Help or version text into a closed pipe ends quietly, exit 0, as `git --help | head`
    does: the reader stopped reading on purpose (Typer and rich printed an error, exit 1).

    Typer keeps its Click exceptions private: a usage error is known by exit code 2 and
    `format_message`, and a bare `mimo-tts` (help, then exit 2) is left to Typer."""
    try:
        yield
    except (BrokenPipeError, SystemExit) as exc:
        # rich's Console answers a broken pipe with SystemExit(1), raised while handling it
        if not isinstance(exc, BrokenPipeError) and not isinstance(exc.__context__,
                                                                   BrokenPipeError):
            raise
        _broken_pipe()  # the reader has what it wanted (`--help | head`): nothing to say
        raise typer.Exit(EXIT_OK) from None
    except Exception as exc:
        if (getattr(exc, "exit_code", None) != EXIT_USAGE or not hasattr(exc, "format_message")
                or type(exc).__name__ == "NoArgsIsHelpError"):
            raise
        reporter = Reporter()
        if reporter.err.is_terminal:
            raise
        ctx = getattr(exc, "ctx", None)
        message = " ".join(exc.format_message().split())
        reporter.error(message.rstrip(".") + (f"; see {ctx.command_path} --help" if ctx else ""))
        raise typer.Exit(EXIT_USAGE) from None


app = typer.Typer(
    name="mimo-tts", no_args_is_help=True, rich_markup_mode="rich", epilog=EXAMPLES,
    pretty_exceptions_enable=False, cls=App,
    context_settings={"help_option_names": ["--help", "-h"]},  # inherited by every command
    help="Offline text-to-speech with Xiaomi MiMo-Audio: Stage-0 LM -> codes, Stage-1 -> wav.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mimo-tts {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Offline text-to-speech with Xiaomi MiMo-Audio."""


# In this order in the help: the run, its preflight, then the other commands.
app.command(cls=Command, epilog=EXAMPLES)(synth.synth)
for _command in (synth.devices, book.book, tools.status, decode.decode, tools.download,
                 tools.selftest, tools.serve):
    app.command(cls=Command)(_command)
voices_app = typer.Typer(name="voices", no_args_is_help=True, cls=App, help=voices.HELP)
for _name, _command in voices.COMMANDS.items():
    voices_app.command(_name, cls=Command)(_command)
app.add_typer(voices_app)
app.command(cls=Command)(wyoming.wyoming)


def main() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
