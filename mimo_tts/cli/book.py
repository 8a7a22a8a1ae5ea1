"""`mimo-tts book`: a book (.txt, .md, .epub) read aloud into a folder: its pieces through the
batch runner (resumable, shardable), then a file per chapter, book.m4b, captions and
book.json (`mimo_tts/book/`). `--list` shows the chapters without loading anything."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from mimo_tts.cli.params import OUT, RUN, Debug, Quiet, Verbose, takes
from mimo_tts.cli.report import Reporter, quiet_libraries, run_command
from mimo_tts.errors import EXIT_OK
from mimo_tts.synthesis.audio import FORMATS
from mimo_tts.synthesis.settings import OptionValues

BOOK = "Book"


@takes("book")
def book(
    input: Annotated[str, typer.Argument(
        metavar="BOOK", help="The book: .txt (chapters at headings such as 'Chapter 3'), .md "
                             "(chapters at headings) or .epub (the spine's documents).")],
    list_chapters: Annotated[bool, typer.Option(
        "--list", rich_help_panel=BOOK, help="Print the chapters (number, title, characters, "
        "estimated minutes) and exit; loads no model.")] = False,
    chapters: Annotated[str | None, typer.Option(
        rich_help_panel=BOOK, metavar="LIST",
        help="The chapters to read, such as 1-3,7 (default: all).")] = None,
    title: Annotated[str | None, typer.Option(
        rich_help_panel=BOOK, metavar="TEXT", help="The book's title (default: its own, or "
                                                   "the file's name).")] = None,
    author: Annotated[str | None, typer.Option(
        rich_help_panel=BOOK, metavar="TEXT", help="The book's author (default: its own).")
    ] = None,
    format: Annotated[str, typer.Option(
        "--format", rich_help_panel=OUT, metavar="FORMAT",
        help=f"The chapter files' format: {', '.join(FORMATS)} (default wav).")] = "wav",
    no_m4b: Annotated[bool, typer.Option(
        "--no-m4b", rich_help_panel=OUT, help="No book.m4b (it needs pip install "
        "'mimo-tts\\[book]').")] = False,
    items_out: Annotated[str | None, typer.Option(
        rich_help_panel=BOOK, metavar="FILE", help="Write the pieces as JSON lines (id, text, "
        "seed, task) for synth --input or scripts/ray_synth.py, and exit.")] = None,
    *, options: OptionValues, config: str | None, shard: str | None,
    voice_per_piece: bool | None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=RUN,
        help="JSON on stdout: the chapter table (--list), or one object per piece and one "
             "for the book.")] = False,
    quiet: Quiet = False,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Read a book aloud: [b]DIR/chapters/[/b], [b]book.m4b[/b], captions, book.json."""
    from mimo_tts.book.plan import BookRequest

    request = BookRequest(input, options, chapters, title, author, format, not no_m4b, shard,
                          config, as_json, bool(voice_per_piece))
    reporter = Reporter(quiet, verbose, as_json, debug)
    run_command(reporter, lambda: (listing(reporter, request) if list_chapters
                                   else read_aloud(reporter, request, items_out)))


def listing(reporter: Reporter, request) -> int:
    """`--list`: the chapter table on stdout (notes on stderr); nothing loads."""
    from mimo_tts.book.plan import select_chapters, table, table_lines
    from mimo_tts.book.read import read_book

    found = read_book(request.input, request.title, request.author)
    select_chapters(request.chapters, len(found.chapters))  # a bad --chapters says so
    listed = table(found)
    for note in listed["notes"]:
        reporter.info(f"note: {note}")
    if reporter.as_json:
        reporter.data(listed)
    else:
        for line in table_lines(listed):
            reporter.data(line)
    return EXIT_OK


def read_aloud(reporter: Reporter, request, items_out: str | None) -> int:
    """Plan, synthesise the pieces (progress on stderr), assemble, report. Nothing is written
    into the book's folder before its pieces' folder lock is held (the sink's): a run refused
    by it leaves the folder as it was."""
    from mimo_tts.batch.files import stdout_stream
    from mimo_tts.batch.results import exit_code_for
    from mimo_tts.batch.runner import BatchRunner
    from mimo_tts.book.assemble import assemble
    from mimo_tts.book.plan import ITEMS_NAME, plan_book, write_items
    from mimo_tts.cli.synth import check_voice

    stdout_stream()  # a run reports on stdout: a closed one ends it before any work
    if reporter.quiet:
        quiet_libraries()
    bplan = plan_book(request, reporter.log, outputs=items_out is None)
    for note in bplan.book.notes:
        reporter.info(f"note: {note}")
    task = bplan.settings.synthesis.task
    check_voice(bplan)
    if items_out is not None:
        _read_voice(reporter, bplan)
        reporter.data(str(write_items(Path(items_out), bplan.plan.items, task)))
        return EXIT_OK
    runner = BatchRunner(bplan.settings, log=reporter.log)
    runner.resolve()  # a missing checkpoint ends the run here, before anything is written
    start = time.perf_counter()
    with runner, bplan.plan.sink() as sink:  # the pieces' lock held; the engine closed after
        _read_voice(reporter, bplan)
        write_items(bplan.folder / ITEMS_NAME, [i for v in bplan.chapters.values() for i in v],
                    task)
        results = _synthesize(reporter, bplan, runner, sink)
    elapsed = time.perf_counter() - start
    done = assemble(bplan, runner.resolve(), reporter.log)
    _report(reporter, bplan, done, results, runner, elapsed)
    return exit_code_for(results)


def _read_voice(reporter: Reporter, bplan) -> None:
    """The book's voice, read when it is not there yet (`book.voice`)."""
    if bplan.voice is not None:
        from mimo_tts.book.voice import read_voice

        if read_voice(bplan.voice, reporter.log):
            reporter.info(f"book voice: {bplan.voice.path} (the first piece in the model's own "
                          "voice; every piece is read with it)")


def _synthesize(reporter: Reporter, bplan, runner, sink) -> list:
    """Each piece through the batch runner, in book order, each chapter written as soon as its
    pieces are done; the bar says the chapter."""
    from mimo_tts.book.assemble import ChapterWriter

    items, count, task = bplan.plan.items, len(bplan.book.chapters), bplan.settings.synthesis.task
    writer = ChapterWriter(bplan, runner.resolve(), reporter.log)
    left = Counter(bplan.chapter_of(item).number for item in items)
    lines = not reporter.err.is_terminal  # off a terminal (a log): a line per chapter
    results, start = [], time.perf_counter()
    with reporter.bar(len(items), "reading") as advance:
        for result in runner.run(items, sink):
            results.append(result)
            if reporter.as_json or result.status == "error":
                reporter.item(result, task)
            writer.settled(result.item)
            chapter = bplan.chapter_of(result.item)
            advance(f"chapter {chapter.number}/{count} {chapter.title[:24]}")
            left[chapter.number] -= 1
            if lines and not left[chapter.number]:
                reporter.info(f"chapter {chapter.number}/{count} read: {chapter.title} "
                              f"({len(results)} of {len(items)} pieces, "
                              f"{time.perf_counter() - start:.0f} s)")
    return results


def _report(reporter: Reporter, bplan, done, results: list, runner, elapsed: float) -> None:
    from mimo_tts.cli.synth import summary

    if reporter.as_json:
        reporter.data({"book": str(bplan.folder), "complete": done.complete,
                       "seconds": done.record["seconds"], "waiting": done.waiting,
                       "outputs": [str(p) for p in done.outputs]})
    else:
        for path in done.outputs:
            reporter.data(str(path))
    reporter.info(summary(results, runner, elapsed))
    reporter.info(book_line(bplan, done))


def book_line(bplan, done) -> str:
    """The book's one line: its length and folder, or what it still waits for."""
    count = len(bplan.book.chapters)
    if done.complete:
        minutes, secs = divmod(round(done.record["seconds"]), 60)
        chapters = "1 chapter" if count == 1 else f"{count} chapters"
        return (f"book: {chapters}, {minutes // 60}:{minutes % 60:02d}:{secs:02d} of audio in "
                f"{bplan.folder}"
                + ("" if bplan.request.m4b else " (no m4b)"))
    waiting = ", ".join(map(str, done.waiting))
    outputs = "book.m4b and the captions" if bplan.request.m4b else "the captions"
    return (f"book: {count - len(done.waiting)} of {count} chapters done; {outputs} wait for "
            f"{sum(done.waiting.values())} piece(s) of chapter(s) {waiting}")
