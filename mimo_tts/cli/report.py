"""Where a command's messages go, and how its errors end it.

Data goes to stdout (written paths, `--json` lines, audio with `-o -`/`--raw`); logs, progress
and errors go to stderr. Errors are one `Error:` line with a documented exit code (README
"Exit codes", and docs/reliability.md); `--debug` adds the traceback. SIGINT, SIGTERM and
SIGHUP stop a run after cleaning up (exit 130): finished items are kept and a re-run resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

import typer
from rich.console import Console

from mimo_tts.batch.files import write_stdout_line
from mimo_tts.errors import EXIT_BUG, EXIT_INTERRUPTED, EXIT_OK, MimoTTSError


class Reporter:
    """Where messages go: stderr for logs/progress/errors, stdout for data."""

    def __init__(self, quiet=False, verbose=False, as_json=False, debug=False, stdout_data=True):
        self.quiet, self.verbose, self.as_json, self.debug = quiet, verbose, as_json, debug
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.stdout_text = stdout_data  # stdout takes text (not audio bytes: -o -, --raw)
        self.stdout_data = stdout_data and not as_json
        self.progress = None

    def log(self, message: str) -> None:
        if self.verbose and not self.quiet:
            self.err.print(message, markup=False)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, markup=False)

    def error(self, message: str) -> None:
        self.err.print(f"[bold red]Error:[/bold red] {message}" if self.err.is_terminal
                       else f"Error: {message}", markup=self.err.is_terminal, highlight=False)

    def data(self, obj) -> None:
        """A JSON object (with --json) or a plain line on stdout."""
        text = json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else str(obj)
        write_stdout_line(text)

    @contextlib.contextmanager
    def bar(self, total: int, description: str):
        """A progress bar with the time left on stderr, only on a terminal and never with
        --quiet/--json; it yields `advance(description=None, steps=1)`, which can also say
        where the run is now."""
        if self.quiet or self.as_json or not self.err.is_terminal or total < 2:
            yield lambda description=None, steps=1: None
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = ["[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
        # Data lines stay on stdout: rich may only route them above the bar when stdout is
        # the very terminal the bar is drawn on.
        with Progress(*columns, console=self.err, transient=True,
                      redirect_stdout=_same_terminal(), redirect_stderr=False) as progress:
            task = progress.add_task(description, total=total)

            def advance(description: str | None = None, steps: int = 1) -> None:
                progress.update(task, advance=steps, **({"description": description}
                                                        if description else {}))

            yield advance

    def item(self, result, task: str) -> None:
        record = result.record(task)
        if self.as_json:
            self.data(record)
        elif result.status == "error":
            self.err.print(f"failed {result.item.id}: {result.error}", markup=False)
        else:  # written or skipped (done before): its path either way, so $(...) works again
            if result.status == "skipped":
                self.log(f"skipped {result.path} (done with the same inputs)")
            if result.path is not None and self.stdout_data:
                self.data(str(result.path))


def _same_terminal() -> bool:
    """Whether stdout and stderr are one terminal (device and inode)."""
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no real fds (e.g. captured streams)
        return False
    return os.isatty(sys.stdout.fileno()) and os.path.samestat(out, err)


def run_command(reporter: Reporter, body) -> None:
    """Run a command body, mapping typed errors and interrupts to one line and an exit code."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_interrupt)
    try:
        code = body()
    except MimoTTSError as exc:
        if reporter.debug:
            reporter.err.print_exception()
        code = _run_error(reporter, str(exc), exc.exit_code)
    except KeyboardInterrupt:
        code = _run_error(reporter, "interrupted; finished items are kept: re-run the same "
                          "command to resume", EXIT_INTERRUPTED)
    except Exception as exc:  # a bug: say so, with the trace under --debug
        if reporter.debug:
            reporter.err.print_exception()
        code = _run_error(reporter, f"unexpected {type(exc).__name__}: {exc} (re-run with "
                          "--debug)", EXIT_BUG)
    raise typer.Exit(code or EXIT_OK)


def _run_error(reporter: Reporter, message: str, code: int) -> int:
    """A run-level error: the `Error:` line, and under --json one JSON object on stdout."""
    reporter.error(message)
    if reporter.as_json and reporter.stdout_text:
        with contextlib.suppress(MimoTTSError):  # stdout itself may be what failed
            reporter.data({"status": "error", "error": message, "exit_code": code})
    return code


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def quiet_libraries() -> None:
    """--quiet: what the libraries print on stderr is cut to errors too (vLLM's logs and its
    loading bar, torch's C++ and Python warnings), set before they are imported; a variable
    the user set stays."""
    import warnings

    for name, value in (("VLLM_LOGGING_LEVEL", "ERROR"), ("TORCH_CPP_LOG_LEVEL", "ERROR"),
                        ("TORCH_LOGS", "-torch"), ("TQDM_DISABLE", "1")):
        os.environ.setdefault(name, value)
    warnings.simplefilter("ignore")
