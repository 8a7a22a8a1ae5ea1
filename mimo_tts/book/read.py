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
    text = unicodedata.normalize("NFC", text)
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text
                   if unicodedata.category(c) not in ("Cf", "Cs", "Co"))
    return " ".join(text.split())


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
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
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

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_RULE = re.compile(r" {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*")
_REFERENCE = re.compile(r" {0,3}\[[^\]]+\]:\s*\S+.*")
_MARKER = re.compile(r"^(?:\s*>)*\s*(?:[-+*]|\d{1,9}[.)])?\s+|^(?:\s*>)+\s*")
_INLINE = [
    (re.compile(r"<!--.*?-->", re.DOTALL), ""),  # comments
    (re.compile(r"!\[[^\]]*\]\([^)]*\)|!\[[^\]]*\]\[[^\]]*\]"), ""),  # images
    (re.compile(r"\[([^\]]*)\]\([^)]*\)|\[([^\]]*)\]\[[^\]]*\]"),  # links: their text
     lambda m: m[1] if m[1] is not None else m[2]),
    (re.compile(r"<(?:https?|mailto):[^>]*>"), ""),  # autolinks
    (re.compile(r"</?[A-Za-z][^>]*>"), ""),  # HTML tags
    (re.compile(r"`+([^`]*)`+"), r"\1"),  # code spans: their text
    (re.compile(r"(\*{1,3}|~~)(?=\S)(.+?)(?<=\S)\1"), r"\2"),  # emphasis, strikeout
    (re.compile(r"(?<!\w)(_{1,3})(?=\S)(.+?)(?<=\S)\1(?!\w)"), r"\2"),  # not in snake_case
    (re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])"), r"\1"),  # escapes
    (re.compile(r"\|"), " "),  # table cells
]


def markdown_inline(text: str) -> str:
    """A Markdown paragraph's text without its markup (links keep their text; images go)."""
    for pattern, replacement in _INLINE:
        text = pattern.sub(replacement, text)
    return html.unescape(text)


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
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
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
        elif heading := _ATX.fullmatch(line):
            end_paragraph()
            blocks.append(("heading", len(heading[1]), heading[2] or ""))
        elif not line.strip() or _RULE.fullmatch(line) or _REFERENCE.fullmatch(line):
            end_paragraph()
        elif line.startswith(("    ", "\t")) and not buffer:
            continue  # an indented code block
        else:
            buffer.append(_MARKER.sub("", line).strip())
    end_paragraph()
    return blocks
