"""Books -> chapters: `.txt` (the heading rule below), `.md` (headings) and `.epub` (`epub.py`).

A `Book` is its title, author and numbered chapters; a `Chapter` is its title and paragraphs of
plain text (whitespace collapsed, control and format characters gone), its heading first where
the text has one, so that the heading is read aloud. A chapter whose text is only headings is
dropped with a note (`Book.notes`); a book with no text at all is an InputError (exit 9).

The `.txt` heading rule: a chapter starts at a line that stands alone (a blank line, or the
file's start or end, on both sides), is at most `HEADING_CHARS` long and is one of
- `Chapter`, `Part`, `Book` or `Volume` with a number (`12`, `XII`, `twelve`, `twenty-one`),
  then optionally a title after `:`, `.` or a dash (`CHAPTER III. THE RETURN`), or after a
  space when it starts with a capital letter and does not end a sentence (`Chapter 3 The
  Return`, not `Chapter 3 is where it began.`);
- `Prologue`, `Epilogue`, `Preface`, `Foreword`, `Introduction`, `Interlude`, `Afterword`,
  `Appendix` or `Epigraph`, alone or with a title after `:`, `.` or a dash;
- a number alone (`12`, `12.`, `XII`), in capital Roman numerals or digits;
- `第…章` (also `回`, `节`, `卷`, `部`, `篇`) with a Chinese or Arabic number.
Text before the first heading (all of it, when there is none) is a chapter titled by the book.

Limits: a `.txt` or `.md` file of at most `MAX_BOOK_BYTES` (64 MiB); reading is linear in its
length (the Markdown inline markup included), so the limit bounds the time and memory `--list`
may take.

No torch, no optional package: `--list` runs on any install.
"""

from __future__ import annotations

import html
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from mimo_tts.errors import InputError

HEADING_CHARS = 80  # a longer line is never a .txt heading
MAX_BOOK_BYTES = 64 * 2**20  # a .txt or .md book (an EPUB has its own limits: epub.py)
SUFFIXES = {".txt": "txt", ".text": "txt", ".md": "md", ".markdown": "md", ".epub": "epub"}


@dataclass(frozen=True)
class Chapter:
    """One chapter: its number in the book's table (1, 2, ...), title and paragraphs."""

    number: int
    title: str
    paragraphs: tuple[str, ...]

    @property
    def characters(self) -> int:
        return sum(len(p) for p in self.paragraphs)

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


@dataclass(frozen=True)
class Book:
    """A book read from a file: title, author, chapters (each with text) and notes on what
    was left out."""

    title: str
    author: str | None
    chapters: tuple[Chapter, ...]
    source: Path
    notes: tuple[str, ...] = ()

    def chapter(self, number: int) -> Chapter:
        return self.chapters[number - 1]


@dataclass
class Section:
    """A chapter before numbering: a title (None: not known yet), paragraphs, and how many of
    them are text rather than headings (none: the section is empty)."""

    title: str | None
    paragraphs: list[str] = field(default_factory=list)
    texts: int = 0

    def add(self, paragraph: str, heading: bool = False) -> None:
        paragraph = plain(paragraph)
        if paragraph:
            self.paragraphs.append(paragraph)
            self.texts += not heading


def plain(text: str) -> str:
    """Text as it is spoken: NFC, control and format characters (soft hyphens, zero-width
    spaces, bidi marks) removed, whitespace collapsed."""
    text = unicodedata.normalize("NFC", text).translate(_SPOKEN)
    return " ".join(text.split())


class _Spoken(dict):
    """`str.translate`'s table for `plain`: a control character -> a space, a format, surrogate
    or private-use character -> nothing, the rest kept. Each character's category is looked up
    once (the table keeps the first `LIMIT` it meets), so the translation runs at C speed."""

    LIMIT = 1 << 16

    def __missing__(self, code: int):
        category = unicodedata.category(chr(code))
        value = " " if category == "Cc" else None if category in ("Cf", "Cs", "Co") else code
        if len(self) < self.LIMIT:
            self[code] = value
        return value


_SPOKEN = _Spoken()


def read_book(path: str | Path, title: str | None = None, author: str | None = None) -> Book:
    """The book in a `.txt`, `.md` or `.epub` file; `title`/`author` override its own."""
    path = Path(path)
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise InputError(f"{path.name}: not a book file; give a .txt, .md or .epub file")
    if not path.is_file():
        raise InputError(f"book not found: {path}" if not path.exists()
                         else f"{path} is not a file")
    if kind == "epub":
        from mimo_tts.book.epub import read_epub

        own_title, own_author, sections = read_epub(path)
    else:
        text = _decode(path)
        own_title, own_author, sections = (read_txt if kind == "txt" else read_md)(text)
    name = plain(title or own_title or "") or path.stem.replace("_", " ")
    return number_chapters(path, name, plain(author or own_author or "") or None, sections)


def number_chapters(path: Path, title: str, author: str | None,
                    sections: list[Section]) -> Book:
    """Number the sections that have text; the others become notes. An untitled section is
    titled by the book when it comes first (the text before the first heading), else by its
    number."""
    chapters, notes = [], []
    for section in sections:
        if not section.texts:
            if section.paragraphs:  # headings only: a part's title page, a title heading
                notes.append(f"{section.title or section.paragraphs[0]!r} has no text besides "
                             "its heading: skipped")
            continue
        number = len(chapters) + 1
        name = plain(section.title or "") or (title if number == 1 else f"Chapter {number}")
        chapters.append(Chapter(number, name, tuple(section.paragraphs)))
    if not chapters:
        raise InputError(f"{path.name} has no text to read")
    return Book(title, author, tuple(chapters), path, tuple(notes))


def _decode(path: Path) -> str:
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            data = handle.read(MAX_BOOK_BYTES + 1) if size <= MAX_BOOK_BYTES else b""
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    if max(size, len(data)) > MAX_BOOK_BYTES:  # before reading, or grown while read
        raise InputError(f"{path.name} is {max(size, len(data)) / 2**20:.1f} MiB; a book file "
                         f"may be at most {MAX_BOOK_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path.name} is not UTF-8 text (invalid byte at {exc.start})") from None


# --- .txt ------------------------------------------------------------------------------------

_NUMBER_WORDS = ("one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
                 "fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|thirty|forty|"
                 "fifty|sixty|seventy|eighty|ninety|hundred")
_NUMBER = rf"(?:\d{{1,4}}|[ivxlcdm]+|(?:{_NUMBER_WORDS})(?:[-\s](?:{_NUMBER_WORDS}))?)\b"
_TITLED = r"(?:\s*[.:—–-]\s*\S.*|\s+(?-i:[A-Z0-9\"'“‘])(?:.*[^.!?])?)"  # a title after it
_LABEL = rf"(?:chapter|part|book|volume)\s+{_NUMBER}(?:{_TITLED}|[.:]?)"
_WORD = (r"(?:prologue|epilogue|preface|foreword|introduction|interlude|afterword|appendix|"
         r"epigraph)(?:\s*[.:—–-]\s*\S.*|[.:]?)")
_ALONE = r"(?-i:[IVXLCDM]+)\.?|\d{1,4}\.?"
_CJK = r"第[\d零〇一二三四五六七八九十百千两]+[章回节卷部篇].*"
HEADING = re.compile(rf"(?:{_LABEL}|{_WORD}|{_ALONE}|{_CJK})", re.IGNORECASE)


def is_heading(line: str) -> bool:
    """Whether a line standing alone starts a `.txt` chapter (the module's heading rule)."""
    line = line.strip()
    return len(line) <= HEADING_CHARS and HEADING.fullmatch(line) is not None


def read_txt(text: str) -> tuple[None, None, list[Section]]:
    """Sections of plain text: paragraphs are separated by blank lines; a paragraph of one
    line that `is_heading` starts a chapter."""
    sections = [Section(None)]
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if len(lines) == 1 and is_heading(lines[0]):
            sections.append(Section(lines[0]))
            sections[-1].add(lines[0], heading=True)
        elif lines:
            sections[-1].add(" ".join(lines))
    return None, None, sections


# --- .md -------------------------------------------------------------------------------------

_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_RULE = re.compile(r" {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*")
_REFERENCE = re.compile(r" {0,3}\[[^\]]+\]:\s*\S+.*")
_MARKER = re.compile(r"^(?:\s*>)*\s*(?:[-+*]|\d{1,9}[.)])?\s+|^(?:\s*>)+\s*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")


def markdown_inline(text: str) -> str:
    """A Markdown paragraph's text without its markup (links keep their text; images go).

    In order: comments, images, links (their text), autolinks, HTML tags, code spans (their
    text), emphasis and strikeout with `*` or `~~`, emphasis with `_` (not in snake_case),
    backslash escapes, table bars. Each step is one pass over the text in linear time: where a
    construct has no end, no later start can find one either, so nothing is scanned twice
    (the regular expressions they replace, with the same results, tried each start anew)."""
    text = _drop_comments(text)
    text = _bracketed(text, "![", keep=False)  # ![alt](src), ![alt][ref]
    text = _bracketed(text, "[", keep=True)  # [text](href), [text][ref]
    text = _angled(text, autolinks=True)  # <https://...>, <mailto:...>
    text = _angled(text, autolinks=False)  # <tag ...>, </tag>
    text = _code_spans(text)
    text = _emphasis(text, "*")
    text = _emphasis(text, "_")
    text = _ESCAPE.sub(r"\1", text)
    return html.unescape(text.replace("|", " "))


class _Next:
    """`str.find` of one needle for queries that only move forward: the last answer is kept,
    so a pass finds each occurrence once however many starts ask."""

    def __init__(self, text: str, needle: str):
        self.text, self.needle, self.asked, self.found = text, needle, -1, -1

    def at(self, start: int) -> int:
        if not (0 <= self.asked <= start and (self.found == -1 or self.found >= start)):
            self.asked, self.found = start, self.text.find(self.needle, start)
        return self.found


def _drop_comments(text: str) -> str:
    """`<!-- ... -->` removed (an unclosed one is kept, as everything after it)."""
    out, at = [], 0
    while (start := text.find("<!--", at)) != -1:
        end = text.find("-->", start + 4)
        if end == -1:
            break
        out.append(text[at:start])
        at = end + 3
    out.append(text[at:])
    return "".join(out)


def _bracketed(text: str, opener: str, keep: bool) -> str:
    """`OPENER text](...)` or `OPENER text][...]` -> the text (`keep`) or nothing."""
    closing, paren, ref = _Next(text, "]"), _Next(text, ")"), _Next(text, "]")
    out, at, pos = [], 0, 0
    while (start := text.find(opener, pos)) != -1:
        inner = start + len(opener)
        close = closing.at(inner)
        if close == -1:
            break  # no "]" after this start, so none after any later one
        after = text[close + 1:close + 2]
        end = paren.at(close + 2) if after == "(" else ref.at(close + 2) if after == "[" else -1
        if end == -1:
            pos = start + 1
            continue
        out += [text[at:start], text[inner:close] if keep else ""]
        at = pos = end + 1
    out.append(text[at:])
    return "".join(out)


def _angled(text: str, autolinks: bool) -> str:
    """Autolinks (`<https:...>`, `<mailto:...>`) or HTML tags (`<a ...>`, `</a>`) removed."""
    closing = _Next(text, ">")
    out, at, pos = [], 0, 0
    while (start := text.find("<", pos)) != -1:
        body = _autolink_body(text, start) if autolinks else _tag_body(text, start)
        end = closing.at(body) if body != -1 else -1
        if end == -1:
            pos = start + 1
            continue
        out.append(text[at:start])
        at = pos = end + 1
    out.append(text[at:])
    return "".join(out)


def _autolink_body(text: str, start: int) -> int:
    for scheme in ("http:", "https:", "mailto:"):
        if text.startswith(scheme, start + 1):
            return start + 1 + len(scheme)
    return -1


def _tag_body(text: str, start: int) -> int:
    name = start + 2 if text.startswith("/", start + 1) else start + 1
    first = text[name:name + 1]
    return name + 1 if first and first in _ASCII_LETTERS else -1


_ASCII_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _code_spans(text: str) -> str:
    """`` `code` `` -> its text: a run of backticks to the next backtick's run."""
    out, at, size = [], 0, len(text)
    start = text.find("`")
    while start != -1:
        inner = _run_end(text, start, "`")
        close = text.find("`", inner)
        if close == -1:  # no closing run: a run of two or more is a span of nothing
            if inner - start >= 2:
                out.append(text[at:start])
                at = inner
            break
        out += [text[at:start], text[inner:close]]
        at = _run_end(text, close, "`")
        start = text.find("`", at) if at < size else -1
    out.append(text[at:])
    return "".join(out)


def _run_end(text: str, at: int, char: str) -> int:
    while at < len(text) and text[at] == char:
        at += 1
    return at


def _emphasis(text: str, mark: str) -> str:
    """Emphasis -> its text. `*`: a run of one to three stars (or `~~`) before a non-space,
    to the first equal run after a non-space on the same line. `_`: the same with one to
    three underscores, neither run touching a letter or digit on its outer side."""
    ends = {}  # delimiter -> _Next over its closing positions
    newline = _Next(text, "\n")
    starts = re.compile(r"[*~]" if mark == "*" else r"_")
    out, at, pos = [], 0, 0
    while (found := starts.search(text, pos)) is not None:
        start = found.start()
        match = _emphasis_at(text, start, mark, ends, newline)
        if match is None:
            pos = start + 1
            continue
        inner, end, size = match
        out += [text[at:start], text[inner:end]]
        at = pos = end + size
    out.append(text[at:])
    return "".join(out)


def _emphasis_at(text: str, start: int, mark: str, ends: dict, newline: _Next):
    """(inner start, inner end, delimiter size) of the emphasis opening at `start`, or None."""
    if mark == "_" and start > 0 and _word(text[start - 1]):
        return None
    if text[start] == "~":
        sizes = (2,) if text.startswith("~~", start) else ()
    else:
        sizes = range(min(_run_end(text, start, mark) - start, 3), 0, -1)
    for size in sizes:
        delimiter, inner = text[start:start + size], start + size
        if inner >= len(text) or text[inner].isspace():
            continue
        if delimiter not in ends:
            ends[delimiter] = _Closing(text, delimiter, word_bound=mark == "_")
        end = ends[delimiter].at(inner + 1)
        line_end = newline.at(start)
        if end != -1 and (line_end == -1 or line_end >= end):
            return inner, end, size
    return None


class _Closing:
    """The first closing delimiter at or after a position: after a non-space, and (for `_`)
    not followed by a letter or digit; queries move forward (`_Next`)."""

    def __init__(self, text: str, delimiter: str, word_bound: bool):
        self.text, self.delimiter, self.word_bound = text, delimiter, word_bound
        self.find, self.asked, self.found = _Next(text, delimiter), -1, -1

    def at(self, start: int) -> int:
        if 0 <= self.asked <= start and (self.found == -1 or self.found >= start):
            return self.found
        at = start
        while (at := self.find.at(at)) != -1 and not self._closes(at):
            at += 1
        self.asked, self.found = start, at
        return at

    def _closes(self, at: int) -> bool:
        after = at + len(self.delimiter)
        return (at > 0 and not self.text[at - 1].isspace()
                and not (self.word_bound and after < len(self.text) and _word(self.text[after])))


def _word(char: str) -> bool:
    """`\\w` of Python's regular expressions: a letter, digit or underscore."""
    return char.isalnum() or char == "_"


def read_md(text: str) -> tuple[str | None, str | None, list[Section]]:
    """Sections of Markdown: chapters start at the shallowest heading level that occurs more
    than once (at the shallowest level there is, when none does); a shallower heading before
    the first chapter is the book's title (read with the text before the first chapter),
    deeper headings are read as paragraphs. A YAML front matter's `title:` and `author:`
    name the book. Code blocks are not read."""
    meta, text = _front_matter(text)
    blocks = _md_blocks(text)
    levels = [level for kind, level, _ in blocks if kind == "heading"]
    repeated = [lv for lv in sorted(set(levels)) if levels.count(lv) > 1]
    chapter_level = repeated[0] if repeated else min(levels, default=None)
    title = meta.get("title")
    sections = [Section(None)]
    for kind, level, body in blocks:
        if kind == "heading" and level <= chapter_level:
            if level < chapter_level and len(sections) == 1 and levels.count(level) == 1:
                title = title or markdown_inline(body)  # the book's title heading
                sections[0].add(markdown_inline(body), heading=True)
                continue
            sections.append(Section(markdown_inline(body)))
        sections[-1].add(markdown_inline(body), heading=kind == "heading")
    if not sections[0].texts:  # only the title heading before the first chapter: no note
        sections.pop(0)
    return title, meta.get("author"), sections


def _front_matter(text: str) -> tuple[dict[str, str], str]:
    """`---` / `key: value` lines / `---` at the very top (YAML front matter, flat keys)."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "---":
        return {}, text
    for end in range(1, len(lines)):
        if lines[end].strip() in ("---", "..."):
            meta = {}
            for line in lines[1:end]:
                key, sep, value = line.partition(":")
                if sep and key.strip():
                    meta[key.strip().lower()] = value.strip().strip("'\"")
            return meta, "\n".join(lines[end + 1:])
    return {}, text


def _md_blocks(text: str) -> list[tuple[str, int | None, str]]:
    """("heading", level, text) and ("text", None, paragraph) in order; code blocks, rules and
    reference definitions dropped."""
    text = _drop_comments(text)
    blocks: list[tuple[str, int | None, str]] = []
    buffer: list[str] = []
    fence = None

    def end_paragraph():
        if buffer:
            blocks.append(("text", None, " ".join(buffer)))
            buffer.clear()

    for line in text.split("\n"):
        opening = _FENCE.match(line)
        if fence is not None:
            fence = None if opening and opening[1][0] == fence else fence
            continue
        if opening:
            end_paragraph()
            fence = opening[1][0]
        elif _SETEXT.fullmatch(line) and buffer:  # the underlined paragraph is a heading
            blocks.append(("heading", 1 if line.strip()[0] == "=" else 2, " ".join(buffer)))
            buffer.clear()
        elif heading := _atx_heading(line):
            end_paragraph()
            blocks.append(("heading", *heading))
        elif not line.strip() or _RULE.fullmatch(line) or _REFERENCE.fullmatch(line):
            end_paragraph()
        elif line.startswith(("    ", "\t")) and not buffer:
            continue  # an indented code block
        else:
            buffer.append(_MARKER.sub("", line).strip())
    end_paragraph()
    return blocks


def _atx_heading(line: str) -> tuple[int, str] | None:
    """`## Title ##` -> (2, "Title"): up to three spaces, one to six `#`, then nothing or
    whitespace and the title, whose closing `#` run (after whitespace) and trailing
    whitespace are not part of it. One pass (the regular expression it replaces tried each
    length of the title against the rest of the line)."""
    indent = _run_end(line, 0, " ")
    hashes = _run_end(line, indent, "#")
    level = hashes - indent
    if indent > 3 or not 1 <= level <= 6:
        return None
    rest = line[hashes:]
    if not rest:
        return level, ""
    title = rest.lstrip(" \t")
    if len(title) == len(rest):
        return None  # "#5": not a heading
    end = len(title.rstrip(" \t"))
    closing = len(title[:end].rstrip("#"))
    if 0 < closing < end and title[closing - 1] in " \t":  # "Title ##": the run closes it
        end = len(title[:closing].rstrip(" \t"))
    return level, title[:end]
