"""A book's outputs from its pieces' files: one audio file per chapter (`--format`) with its
`.srt` and `.vtt`, each written as soon as the chapter's pieces are done (`ChapterWriter`,
during the run), and once every chapter is done `book.m4b` (`m4b.py`), `book.srt` and
`book.vtt` for the whole book and `book.json` with each chapter's start.

A chapter is its pieces joined with `PAUSE_FRAMES` of silence, as synth joins an item's pieces;
the book is its chapters joined with `CHAPTER_PAUSE_FRAMES`. Every time is counted in samples
from the pieces' own lengths, so a cue (one per piece: captions' `cues`) and a chapter mark sit
exactly where their audio starts. A piece counts when it is done as the batch runner judges it
(`manifest.done_record`: its sidecar holds this run's resume key, its audio the recorded size).

Idempotent: each encoded output is recorded in `book.json` with a stamp of what it was made of
(its pieces' keys, sizes and mtimes, the format, the titles) and its size; an output whose
stamp and size still hold is not written again, and text files whose bytes are unchanged are
left as they are, mtimes included. Outputs are written atomically under an exclusive lock on
`.mimo-tts.book.lock`, so shards finishing together assemble one at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.batch.files import companion_paths
from mimo_tts.batch.items import Item
from mimo_tts.batch.manifest import done_record, flock
from mimo_tts.batch.resume import item_key
from mimo_tts.book.plan import ITEMS_NAME, BookPlan, chapter_captions, chapter_name, chapter_number
from mimo_tts.codec.config import CodecConfig
from mimo_tts.errors import OutputError
from mimo_tts.runtime.paths import atomic_write, clean_temp_files, open_no_follow
from mimo_tts.runtime.safetensors import parse_config
from mimo_tts.synthesis.audio import PAUSE_FRAMES, SAMPLE_RATE, encode_audio
from mimo_tts.synthesis.captions import Cue, caption_text, cues
from mimo_tts.synthesis.markup import default_pauses
from mimo_tts.synthesis.options import CAPTION_FORMATS

CHAPTERS_DIR = "chapters"
BOOK_JSON, M4B_NAME = "book.json", "book.m4b"
CHAPTER_PAUSE_FRAMES = 50  # 2 s of silence between chapters (in the m4b and the captions)
LOCK_NAME = ".mimo-tts.book.lock"
LOCK_WAIT_S = 3600.0  # another run assembling the same book is waited for this long
VERSION = 1  # how outputs are made from pieces: another version redoes every output
OWN_FILES = (BOOK_JSON, M4B_NAME, ITEMS_NAME, *(f"book.{f}" for f in CAPTION_FORMATS))


@dataclass(frozen=True)
class PieceFile:
    """A done piece: its item, audio file, length in samples and stamp."""

    item: Item
    path: Path
    samples: int
    stamp: tuple


@dataclass
class ChapterAudio:
    """A chapter's pieces as found: all of them done (`files`), or how many are missing."""

    number: int
    files: list[PieceFile] | None
    missing: int
    samples_per_frame: int  # of the audio tokenizer: pauses are whole frames

    @property
    def pause(self) -> int:
        """Samples of silence between two pieces (synth's pause between an item's pieces)."""
        return PAUSE_FRAMES * self.samples_per_frame

    @property
    def pauses(self) -> tuple[int, ...]:
        """Samples of silence before each piece and after the last: `pause` between them
        unless the piece's text asked its own (`[pause:]`, `--sentence-silence`: its item's
        `extra`)."""
        files = self.files
        return (*(f.item.extra.get("pause", self.pause if i else 0)
                  for i, f in enumerate(files)),
                files[-1].item.extra.get("after", 0) if files else 0)

    @property
    def samples(self) -> int:
        return sum(f.samples for f in self.files) + sum(self.pauses)

    def stamp(self, *more) -> str:
        pauses = self.pauses
        plain = pauses == default_pauses(len(self.files), self.pause)
        return _hash([VERSION, self.pause, [f.stamp for f in self.files], *more,
                      *([] if plain else [list(pauses)])])


@dataclass
class Assembly:
    """What an assembly found and did: chapters done, pieces missing, outputs written or
    kept, the book's length when it is complete."""

    folder: Path
    record: dict
    waiting: dict[int, int] = field(default_factory=dict)  # chapter -> pieces missing
    written: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    order: list[Path] = field(default_factory=list)  # written and kept, as they came

    def note(self, path: Path, written: bool) -> None:
        (self.written if written else self.kept).append(path)
        self.order.append(path)

    @property
    def complete(self) -> bool:
        return not self.waiting

    @property
    def outputs(self) -> list[Path]:
        """Every output, written or kept, in the order the assembly came to it."""
        return list(self.order)


def _hash(value) -> str:
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def samples_per_frame(refs) -> int:
    """Samples per code frame of the run's audio tokenizer (960: 24 kHz at 25 Hz)."""
    return parse_config(refs[1].path, CodecConfig.from_json).samples_per_frame


def find_pieces(bplan: BookPlan, refs) -> dict[int, ChapterAudio]:
    """Every chapter's done pieces (or its count of missing ones), judged as the runner judges
    an item: its audio and sidecar carry this run's resume key."""
    spf = samples_per_frame(refs)
    return {number: find_chapter(bplan, refs, number, spf) for number in bplan.chapters}


def find_chapter(bplan: BookPlan, refs, number: int, spf: int | None = None) -> ChapterAudio:
    """One chapter's done pieces, or its count of missing ones (`find_pieces`)."""
    settings = bplan.settings
    task_dir = Path(settings.run.output_dir) / settings.synthesis.task
    files, missing = [], 0
    for item in bplan.chapters[number]:
        audio = task_dir / f"{item.id}.wav"
        key = item_key(settings, refs, item, item.seed)
        done = done_record(audio, companion_paths(audio)[0], key)
        if done is None:
            missing += 1
            continue
        info = audio.stat()
        files.append(PieceFile(item, audio, _frames(audio),
                               (item.id, key, info.st_size, info.st_mtime_ns)))
    return ChapterAudio(number, None if missing else files, missing,
                        spf or samples_per_frame(refs))


def _frames(audio: Path) -> int:
    import soundfile as sf

    try:
        info = sf.info(str(audio))
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise OutputError(f"cannot read piece {audio}: {exc}") from None
    if info.samplerate != SAMPLE_RATE or info.channels != 1:
        raise OutputError(f"piece {audio} is {info.channels} channel(s) at {info.samplerate} Hz"
                          f", not mono at {SAMPLE_RATE} Hz")
    return int(info.frames)


def read_piece(path: Path):
    """A piece's samples [S] float32, PCM16 / 32767, so a PCM16 chapter holds its exact
    values."""
    import numpy as np
    import soundfile as sf

    data, _ = sf.read(str(path), dtype="int16", always_2d=False)
    return data.astype(np.float32) / 32767.0


def chapter_blocks(chapter: ChapterAudio):
    """A chapter's samples as blocks: pieces and the pauses between them."""
    import numpy as np

    pauses = chapter.pauses
    for pause, piece in zip(pauses, chapter.files, strict=False):
        if pause:
            yield np.zeros(pause, dtype=np.float32)
        yield read_piece(piece.path)
    if pauses[-1]:
        yield np.zeros(pauses[-1], dtype=np.float32)


class _Outputs:
    """The outputs of one assembly, against what `book.json` recorded last time."""

    def __init__(self, folder: Path, previous: dict, assembly: Assembly):
        self.folder, self.previous, self.assembly = folder, previous, assembly
        self.files: dict[str, dict] = {}

    def current(self, name: str, stamp: str) -> bool:
        """Whether `name` is still what `stamp` makes (then it is kept as it is)."""
        old, path = self.previous.get(name) or {}, self.folder / name
        if old.get("stamp") == stamp and path.is_file() and path.stat().st_size == old.get(
                "bytes"):
            self.files[name] = old
            self.assembly.note(path, written=False)
            return True
        return False

    def made(self, name: str, stamp: str | None = None) -> None:
        path = self.folder / name
        if stamp is not None:
            self.files[name] = {"stamp": stamp, "bytes": path.stat().st_size}
        self.assembly.note(path, written=True)

    def text(self, name: str, data: bytes) -> None:
        """A small file, written only when its bytes change."""
        path = self.folder / name
        if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
            self.assembly.note(path, written=False)
            return
        atomic_write(path, lambda f: f.write(data))
        self.assembly.note(path, written=True)


def assemble(bplan: BookPlan, refs, log=None) -> Assembly:
    """Write what the done pieces allow (module docstring): chapter files and their captions
    for complete chapters; the m4b, captions and chapter starts once the whole book is done."""
    log = log or (lambda message: None)
    folder = bplan.folder
    chapters = find_pieces(bplan, refs)
    (folder / CHAPTERS_DIR).mkdir(parents=True, exist_ok=True)
    with BookLock(folder):
        clean_temp_files(folder / CHAPTERS_DIR)  # a killed assembly's temp files
        clean_temp_files(folder, OWN_FILES)  # (there, only those of dead pids)
        assembly = Assembly(folder, {})
        outputs = _Outputs(folder, _recorded_files(folder), assembly)
        for number, chapter in chapters.items():
            if chapter.files is None:
                assembly.waiting[number] = chapter.missing
            else:
                write_chapter(bplan, chapter, outputs, log)
        starts = _starts(chapters) if assembly.complete else None
        if starts is not None:
            _whole_book(bplan, chapters, starts, outputs, log)
        assembly.record = book_record(bplan, chapters, starts, outputs.files)
        outputs.text(BOOK_JSON, _json_bytes(assembly.record))
    return assembly


def write_chapter(bplan: BookPlan, chapter: ChapterAudio, outputs: _Outputs, log) -> None:
    """A complete chapter's audio file (kept while its stamp holds) and its captions, one cue
    per piece in the chapter file's samples (kept while their bytes are the same)."""
    fmt, title = bplan.request.format, bplan.book.chapter(chapter.number)
    name = f"{CHAPTERS_DIR}/{chapter_name(title, fmt)}"
    stamp = chapter.stamp(fmt)
    if not outputs.current(name, stamp):
        log(f"writing {outputs.folder / name}")
        data = encode_audio(_joined(chapter), SAMPLE_RATE, fmt)
        atomic_write(outputs.folder / name, lambda f: f.write(data), keep_same=True)
        outputs.made(name, stamp)
    found = [c.record() for c in chapter_cues(chapter)]
    for caption in CAPTION_FORMATS:
        outputs.text(f"{CHAPTERS_DIR}/{chapter_captions(title, caption)}",
                     caption_text(found, caption).encode("utf-8"))


class ChapterWriter:
    """Each chapter written while the book is read: once this run's last piece of a chapter
    is settled and every piece of it is done, its file and captions, and `book.json` naming
    them, so a run stopped after chapter 1 leaves chapter 1 (and a later run keeps it)."""

    def __init__(self, bplan: BookPlan, refs, log=None):
        self.bplan, self.refs = bplan, refs
        self.log = log or (lambda message: None)
        self.left = Counter(chapter_number(item.id) for item in bplan.plan.items)
        self.found: dict[int, ChapterAudio] | None = None  # every chapter, once one is written

    def settled(self, item: Item) -> list[Path]:
        """`item` is written, skipped or failed: its chapter's outputs when it completes it
        (the files written; none when they are current or the chapter waits for pieces)."""
        number = chapter_number(item.id)
        self.left[number] -= 1
        if self.left[number]:
            return []
        chapter = find_chapter(self.bplan, self.refs, number)
        if chapter.files is None:  # a failed piece, or another shard's still missing
            return []
        folder = self.bplan.folder
        (folder / CHAPTERS_DIR).mkdir(parents=True, exist_ok=True)
        with BookLock(folder):
            previous = _recorded_files(folder)
            assembly = Assembly(folder, {})
            outputs = _Outputs(folder, previous, assembly)
            write_chapter(self.bplan, chapter, outputs, self.log)
            if not assembly.written:
                return []
            if self.found is None:
                self.found = find_pieces(self.bplan, self.refs)
            self.found[number] = chapter
            record = book_record(self.bplan, self.found, None, {**previous, **outputs.files})
            outputs.text(BOOK_JSON, _json_bytes(record))
        return assembly.written


def _recorded_files(folder: Path) -> dict:
    """The outputs `book.json` records (name -> stamp and size), or none."""
    files = (_read_json(folder / BOOK_JSON) or {}).get("files") or {}
    return files if isinstance(files, dict) else {}


def _json_bytes(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _joined(chapter: ChapterAudio):
    import numpy as np

    return np.concatenate(list(chapter_blocks(chapter)))


def _starts(chapters: dict[int, ChapterAudio]) -> dict[int, int]:
    """Each chapter's first sample in the book (chapters joined with CHAPTER_PAUSE_FRAMES)."""
    starts, at = {}, 0
    for i, (number, chapter) in enumerate(chapters.items()):
        at += CHAPTER_PAUSE_FRAMES * chapter.samples_per_frame if i else 0
        starts[number] = at
        at += chapter.samples
    return starts


def _whole_book(bplan: BookPlan, chapters: dict[int, ChapterAudio], starts: dict[int, int],
                outputs: _Outputs, log) -> None:
    """The captions of the whole book, then its m4b (unless --no-m4b)."""
    found = book_cues(bplan, chapters, starts)
    for fmt in CAPTION_FORMATS:
        outputs.text(f"book.{fmt}", caption_text([c.record() for c in found], fmt).encode())
    if not bplan.request.m4b:
        return
    book, ends = bplan.book, _ends(chapters, starts)
    metadata = {"title": book.title, "album": book.title, "genre": "Audiobook",
                **({"artist": book.author, "album_artist": book.author} if book.author else {})}
    marks = [(starts[n], ends[n], book.chapter(n).title) for n in chapters]
    stamp = _hash([VERSION, [c.stamp() for c in chapters.values()], marks, metadata])
    if outputs.current(M4B_NAME, stamp):
        return
    log(f"writing {outputs.folder / M4B_NAME}")
    from mimo_tts.book.m4b import write_m4b

    write_m4b(outputs.folder / M4B_NAME, _book_blocks(chapters, starts), SAMPLE_RATE, marks,
              metadata)
    outputs.made(M4B_NAME, stamp)


def _ends(chapters: dict[int, ChapterAudio], starts: dict[int, int]) -> dict[int, int]:
    return {n: starts[n] + c.samples for n, c in chapters.items()}


def _book_blocks(chapters: dict[int, ChapterAudio], starts: dict[int, int]):
    """The whole book's samples, block by block (a piece at a time in memory)."""
    import numpy as np

    at = 0
    for number, chapter in chapters.items():
        if starts[number] > at:
            yield np.zeros(starts[number] - at, dtype=np.float32)
        yield from chapter_blocks(chapter)
        at = starts[number] + chapter.samples


def chapter_cues(chapter: ChapterAudio) -> list[Cue]:
    """One cue per piece at its samples in the chapter file: its words (no tags), after its
    pause, naming the voice a tag gave it."""
    words = [f.item.extra.get("words", f.item.text) for f in chapter.files]
    return cues(words, [f.samples for f in chapter.files], SAMPLE_RATE, chapter.pauses,
                [f.item.extra.get("voice") for f in chapter.files])


def book_cues(bplan: BookPlan, chapters: dict[int, ChapterAudio],
              starts: dict[int, int]) -> list[Cue]:
    """One cue per piece, numbered through the book, at its samples in the joined book."""
    out: list[Cue] = []
    for number, chapter in chapters.items():
        for cue in chapter_cues(chapter):
            out.append(Cue(len(out) + 1, cue.text, starts[number] + cue.start_sample,
                           starts[number] + cue.end_sample, SAMPLE_RATE, cue.voice))
    return out


def book_record(bplan: BookPlan, chapters: dict[int, ChapterAudio],
                starts: dict[int, int] | None, files: dict[str, dict]) -> dict:
    """`book.json`: the book, its chapters (pieces done, file, start and end in seconds and
    samples), its outputs with their stamps. Nothing in it changes between equal runs."""
    book, settings, fmt = bplan.book, bplan.settings, bplan.request.format
    ends = _ends(chapters, starts) if starts is not None else {}
    rows = []
    for number, items in bplan.chapters.items():
        chapter, found = book.chapter(number), chapters[number]
        name = f"{CHAPTERS_DIR}/{chapter_name(chapter, fmt)}"
        captions = [f"{CHAPTERS_DIR}/{chapter_captions(chapter, f)}" for f in CAPTION_FORMATS]
        rows.append({
            "number": number, "title": chapter.title, "characters": chapter.characters,
            "pieces": len(items), "done": len(items) - found.missing,
            "first_piece": items[0].id, "file": name if name in files else None,
            "captions": captions if found.files is not None else [],
            "seconds": round(found.samples / SAMPLE_RATE, 6) if found.files else None,
            "start": round(starts[number] / SAMPLE_RATE, 6) if starts else None,
            "end": round(ends[number] / SAMPLE_RATE, 6) if starts else None,
            "start_sample": starts[number] if starts else None,
            "end_sample": ends[number] if starts else None})
    total = max(ends.values()) if ends else None
    o = settings.synthesis
    return {
        "title": book.title, "author": book.author, "source": str(book.source),
        "complete": starts is not None, "task": o.task, "seed": o.seed, "voice": o.voice,
        "book_voice": bplan.voice.path.name if bplan.voice else None,
        "prompt_audio": os.path.abspath(o.prompt_audio) if isinstance(o.prompt_audio, str)
        else None, "items": ITEMS_NAME, "format": fmt, "sample_rate": SAMPLE_RATE,
        "pause_frames": PAUSE_FRAMES, "chapter_pause_frames": CHAPTER_PAUSE_FRAMES,
        "seconds": round(total / SAMPLE_RATE, 6) if total is not None else None,
        "chapters": rows,
        "m4b": M4B_NAME if starts is not None and M4B_NAME in files else None,
        "captions": [f"book.{f}" for f in CAPTION_FORMATS] if starts is not None else [],
        "files": files}


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


class BookLock:
    """The book folder's lock (exclusive `flock`, waited for): assembling, reading the voice."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        try:
            self.handle = open_no_follow(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise OutputError(f"cannot write {self.folder}: {exc.strerror or exc}") from None
        if not flock(self.handle, exclusive=True, wait=LOCK_WAIT_S):
            self.handle.close()
            raise OutputError(f"another mimo-tts run is assembling {self.folder}; wait for it")
        return self

    def __exit__(self, *exc):
        self.handle.close()
