"""A book run, planned: the book read (`read.py`), its chapters selected (`--chapters 1-3,7`),
each chapter cut into pieces (one per sentence, as captions cut text: `captions.caption_pieces`)
and each piece an `Item` of the batch runner, then synth's own plan (`batch.plan.plan_synth`:
settings, devices, checkpoint names, shard).

A piece's id is its place, `c003-p0042` (chapter 3, piece 42), and so is its seed: a hash of
the book's `--seed`, the chapter's number and the piece's number (`piece_seed`). A re-run of one
chapter, alone or in shards, gives the same audio; another `--seed` gives another reading.

A book is one narrator: without `--voice` or `--prompt-audio` the book's first piece, read once
in the model's own voice, is kept in its folder (`VOICE_NAME`, made by `voice.read_voice`)
and every piece is read with it as the voice prompt, so a resumed run, a shard, `--chapters`
and the Ray pipeline (the items name it) clone the same voice. `--voice-per-piece` keeps each
piece in the model's own voice.

The pieces are written as JSON lines (`ITEMS_NAME` in the book's folder, or `--items-out`):
the items `mimo-tts synth --input` and the Ray pipeline read, and what `mimo-tts status` judges
the folder by. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.batch.items import Item, sanitize_id
from mimo_tts.batch.plan import Plan, SynthRequest, plan_synth
from mimo_tts.book.read import Book, Chapter, read_book
from mimo_tts.errors import OutputError, UsageError
from mimo_tts.lm.tasks import TASKS
from mimo_tts.runtime.paths import atomic_write
from mimo_tts.synthesis.audio import FORMATS, SAMPLE_RATE
from mimo_tts.synthesis.markup import DEFAULT_SENTENCE_SILENCE, script, silence_samples
from mimo_tts.synthesis.options import MAX_SEED
from mimo_tts.synthesis.settings import OptionValues, Settings

ITEMS_NAME = "book-items.jsonl"
VOICE_NAME = "book-voice.wav"  # the book's voice: its first piece, in the model's own voice
PIECES_FORMAT = "wav"  # pieces are PCM16 at 24 kHz, joined losslessly into chapters
# Speech rate for `--list`'s estimate: about 150 words (900 characters) a minute in alphabetic
# scripts, about 250 characters a minute in Chinese, Japanese and Korean.
CHARS_PER_MINUTE, CJK_CHARS_PER_MINUTE = 900, 250
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


@dataclass(frozen=True)
class BookRequest:
    """What one `mimo-tts book` asks for: the book file, the synthesis options (as synth's),
    the chapters, the book's outputs, shard and profile."""

    input: str
    options: OptionValues = field(default_factory=OptionValues)
    chapters: str | None = None  # --chapters 1-3,7; None: every chapter
    title: str | None = None  # --title / --author: instead of the book's own
    author: str | None = None
    format: str = "wav"  # the chapter files' format
    m4b: bool = True
    shard: str | None = None
    config: str | None = None
    as_json: bool = False
    voice_per_piece: bool = False  # each piece in the model's own voice (no book voice)

    @property
    def folder(self) -> Path:
        """The book's folder: --output-dir, else output_audio/<the input's stem>."""
        given = self.options.output_dir
        return Path(given) if given else Path("output_audio") / Path(self.input).stem


@dataclass(frozen=True)
class BookVoice:
    """The book's voice (`book_voice`): where it is kept and the plan that reads it there."""

    path: Path  # absolute: the pieces' prompt_audio
    plan: Plan  # one item, the book's first piece, to `path` as `synth -o` writes it


@dataclass
class BookPlan:
    """A planned book: the book, the chapters this run takes, every chapter's pieces (the
    whole book's items), synth's plan of this run's items (its shard's) and the book's voice
    (None with --voice, --prompt-audio or --voice-per-piece)."""

    request: BookRequest
    book: Book
    selected: tuple[int, ...]
    chapters: dict[int, list[Item]]
    plan: Plan
    voice: BookVoice | None = None

    @property
    def folder(self) -> Path:
        return self.request.folder

    @property
    def settings(self) -> Settings:
        return self.plan.settings

    def chapter_of(self, item: Item) -> Chapter:
        return self.book.chapter(chapter_number(item.id))


def select_chapters(spec: str | None, count: int) -> tuple[int, ...]:
    """`--chapters 1-3,7` -> (1, 2, 3, 7), in book order; every chapter when None. A number
    outside the book is a UsageError naming the book's range."""
    if spec is None:
        return tuple(range(1, count + 1))
    chosen: set[int] = set()
    for part in spec.split(","):
        match = _RANGE.fullmatch(part)
        if match is None:
            raise UsageError(f"--chapters takes numbers and ranges such as 1-3,7, got {spec!r}")
        low, high = int(match[1]), int(match[2] or match[1])
        if low > high:
            raise UsageError(f"--chapters {part.strip()}: the range runs backwards")
        if low < 1 or high > count:
            raise UsageError(f"--chapters {part.strip()}: the book has {count} chapter"
                             f"{'s' if count != 1 else ''} (1-{count})")
        chosen.update(range(low, high + 1))
    return tuple(sorted(chosen))


def piece_id(chapter: int, piece: int) -> str:
    return f"c{chapter:03d}-p{piece:04d}"


def chapter_number(item_id: str) -> int:
    return int(item_id[1:item_id.index("-")])


def piece_seed(seed: int, chapter: int, piece: int) -> int:
    """A piece's sampling seed: the book's seed and the piece's place, hashed (so neighbouring
    pieces do not get neighbouring seeds), in [0, MAX_SEED]."""
    digest = hashlib.sha256(f"mimo-tts book {seed} {chapter} {piece}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


PAUSE = silence_samples(DEFAULT_SENTENCE_SILENCE)  # between two pieces: synth's, 8 frames


def chapter_script(chapter: Chapter, max_chars: int, silence: int) -> list[tuple]:
    """A chapter's pieces as (text, voice, samples of silence before it): each paragraph's
    sentences, long ones cut at clauses (captions' cut, at most `max_chars` when that is
    smaller), so each piece is one cue. Pause and voice tags are read as in one text
    (`markup.script`, paragraph by paragraph): a voice tag lasts to the next one or the
    chapter's end; a pause at a paragraph's end or start stands for the sentence silence
    there. A chapter that ends with a pause has it as the last tuple's fourth value."""
    out: list[tuple] = []
    voice: str | None = None
    tail = 0  # the pause asked at the previous paragraph's end
    for paragraph in chapter.paragraphs:
        found = script(paragraph, _Cut(max_chars, silence / SAMPLE_RATE))
        for k, (text, named) in enumerate(zip(found.texts, found.voices, strict=True)):
            before = found.pauses[k]
            if k == 0 and out:
                asked = tail + before
                before = asked if asked else silence
            voice = named if named is not None else voice
            out.append((text, voice, before))
        tail = found.pauses[-1]
    if out and tail:
        out[-1] = (*out[-1], tail)
    return out


@dataclass(frozen=True)
class _Cut:
    """The options `markup.script` reads: a book cuts every paragraph as captions do."""

    max_chars: int
    sentence_silence: float
    captions: bool = True


def book_items(book: Book, settings: Settings) -> dict[int, list[Item]]:
    """Every chapter's pieces as items: id and seed from their place, the run's voice prompt;
    a piece's own pause before it (and the chapter's after its last) in `extra`."""
    o = settings.synthesis
    prompt = os.path.abspath(o.prompt_audio) if isinstance(o.prompt_audio, str) else None
    silence = silence_samples(o.sentence_silence)
    out = {}
    for c in book.chapters:
        items = []
        for k, (text, voice, before, *after) in enumerate(
                chapter_script(c, o.max_chars, silence), 1):
            extra = {"pause": before} if before != (PAUSE if k > 1 else 0) else {}
            extra.update({"after": after[0]} if after else {})
            extra.update({"voice": voice, "words": text} if voice else {})
            spoken = f"[voice:{voice}] {text}" if voice else text  # read again by synth
            items.append(Item(id=piece_id(c.number, k), text=spoken,
                              source_id=piece_id(c.number, k),
                              seed=piece_seed(o.seed, c.number, k), prompt_audio=prompt,
                              source=f"{book.source.name} chapter {c.number}", extra=extra))
        out[c.number] = items
    return out


def write_items(path: Path, items: list[Item], task: str) -> Path:
    """The items as JSON lines, as `synth --input` and the Ray pipeline read them, atomically
    (its folder made); an unchanged file is left as it is (its mtime too)."""
    lines = [json.dumps({"id": i.id, "text": i.text, "seed": i.seed, "task": task,
                         **({"prompt_audio": i.prompt_audio} if i.prompt_audio else {})},
                        ensure_ascii=False) for i in items]
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
    return atomic_write(path, lambda f: f.write(data), keep_same=True)


def plan_book(request: BookRequest, log=None, outputs: bool = True) -> BookPlan:
    """Read the book, select its chapters, then synth's plan of their pieces: usage and input
    errors here, before anything is written (with `outputs`, also a missing `book` extra).
    Without a voice prompt (and without `--voice-per-piece`) the pieces clone the book's voice
    (`book_voice`)."""
    log = log or (lambda message: None)
    book = read_book(request.input, request.title, request.author)
    selected = select_chapters(request.chapters, len(book.chapters))
    if request.format not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}")
    if request.m4b and outputs:
        from mimo_tts.book.m4b import require_av

        require_av()
    options = OptionValues.of({**request.options.given(), "output_dir": str(request.folder),
                               "format": PIECES_FORMAT, "sample_rate": SAMPLE_RATE})
    notes: list[str] = []
    plan = _plan_pieces(request, options, book, selected, notes.append)
    run, o = plan.settings.run, plan.settings.synthesis
    if run.output or run.raw or run.stream:
        raise UsageError("a book is written to its --output-dir; a profile's output, raw or "
                         "stream cannot be used with it")
    if request.voice_per_piece and (o.voice or o.prompt_audio):
        raise UsageError("--voice-per-piece reads each piece in the model's own voice; it "
                         "cannot be used with --voice or --prompt-audio")
    voice = None
    if not request.voice_per_piece and o.voice is None and o.prompt_audio is None:
        voice = book_voice(request, book, options, plan.settings)
        # the run's task where it takes a voice prompt, else the clone task (its instruct kept)
        task = o.task if TASKS[o.task].prompt_audio != "none" else "tts_sft_with_audio"
        cloned = {**options.given(), "prompt_audio": str(voice.path), "task": task}
        plan = _plan_pieces(request, OptionValues.of(cloned), book, selected, log)
    else:
        for note in notes:
            log(note)
    return BookPlan(request, book, selected, book_items(book, plan.settings), plan, voice)


def _plan_pieces(request: BookRequest, options: OptionValues, book: Book,
                 selected: tuple[int, ...], log) -> Plan:
    synth = SynthRequest(options, shard=request.shard, config=request.config,
                         as_json=request.as_json)
    chosen = set(selected)
    return plan_synth(synth, log=log, make_items=lambda settings: [
        item for number, items in book_items(book, settings).items() if number in chosen
        for item in items])


def book_voice(request: BookRequest, book: Book, options: OptionValues,
               settings: Settings) -> BookVoice:
    """The book's voice: its first piece (chapter 1's, whichever chapters this run reads),
    with its own seed, read as `synth -o DIR/book-voice.wav` would read it."""
    first, o = book.chapters[0], settings.synthesis
    text = chapter_script(first, o.max_chars, PAUSE)[0][0]  # its first piece's words
    item = Item(id=piece_id(first.number, 1), text=text,
                source_id=piece_id(first.number, 1), seed=piece_seed(o.seed, first.number, 1),
                source=f"{book.source.name} chapter {first.number}")
    path = Path(os.path.abspath(request.folder / VOICE_NAME))
    given = {k: v for k, v in options.given().items() if k != "output_dir"}
    plan = plan_synth(SynthRequest(OptionValues.of({**given, "output": str(path)}),
                                   config=request.config), make_items=lambda _: [item])
    return BookVoice(path, plan)


def chapter_name(chapter: Chapter, fmt: str) -> str:
    """A chapter file's name: `003-The_Return.wav`."""
    return f"{_chapter_stem(chapter)}{FORMATS[fmt][2]}"


def chapter_captions(chapter: Chapter, caption_format: str) -> str:
    """A chapter's caption file's name: `003-The_Return.srt`."""
    return f"{_chapter_stem(chapter)}.{caption_format}"


def _chapter_stem(chapter: Chapter) -> str:
    return f"{chapter.number:03d}-{sanitize_id(chapter.title)[:48]}"


def minutes(text: str) -> float:
    """The estimated reading time of `text` (CHARS_PER_MINUTE, CJK_CHARS_PER_MINUTE)."""
    cjk = len(_CJK.findall(text))
    return (len(text) - cjk) / CHARS_PER_MINUTE + cjk / CJK_CHARS_PER_MINUTE


def table(book: Book) -> dict:
    """`--list`: the book and its chapters (number, title, characters, estimated minutes)."""
    rows = [{"number": c.number, "title": c.title, "characters": c.characters,
             "minutes": round(minutes(c.text), 1)} for c in book.chapters]
    return {"title": book.title, "author": book.author, "source": str(book.source),
            "chapters": rows, "characters": sum(r["characters"] for r in rows),
            "minutes": round(sum(minutes(c.text) for c in book.chapters), 1),
            "notes": list(book.notes)}


def table_lines(listing: dict) -> list[str]:
    """`--list` as aligned text: a header, one row per chapter, the total."""
    rows = [(str(r["number"]), r["title"], str(r["characters"]), f"{r['minutes']:.1f}")
            for r in listing["chapters"]]
    count = len(rows)
    total = ("", f"{count} chapter{'s' if count != 1 else ''}", str(listing["characters"]),
             f"{listing['minutes']:.1f}")
    header = ("#", "title", "characters", "minutes")
    width = [max(len(r[i]) for r in [header, *rows, total]) for i in range(4)]
    byline = f" by {listing['author']}" if listing["author"] else ""
    return [f"{listing['title']}{byline}"] + [
        f"{r[0]:>{width[0]}}  {r[1]:<{width[1]}}  {r[2]:>{width[2]}}  {r[3]:>{width[3]}}"
        .rstrip() for r in [header, *rows, total]]
