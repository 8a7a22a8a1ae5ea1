"""Books -> chapters without a model: the EPUB reader (spine order, titles from the navigation,
cover and nav skipped, XHTML through the HTML parser), the .txt heading rule, Markdown
headings, and the bad inputs (corrupt zip, DRM, no text) as one InputError each (exit 9)."""

from __future__ import annotations

import zipfile

import pytest

from mimo_tts.book.read import is_heading, markdown_inline, read_book
from mimo_tts.errors import EXIT_INPUT, InputError
from tests.book.books import (
    AUTHOR,
    THREE,
    TITLE,
    encryption_xml,
    write_epub,
)


def test_epub_chapters_in_spine_order_titled_by_the_navigation(tmp_path):
    book = read_book(write_epub(tmp_path / "three.epub"))
    assert (book.title, book.author, book.notes) == (TITLE, AUTHOR, ())
    assert [c.title for c in book.chapters] == [name for name, _, _ in THREE]  # no cover, nav
    assert [c.number for c in book.chapters] == [1, 2, 3]
    assert book.chapter(1).paragraphs == (  # the heading read first; entities decoded
        "Chapter 1: The Harbour", "The boats came in at dawn. Gulls followed them & cried.")
    assert book.chapter(2).paragraphs[2] == "His lamp burned all night."  # &#160; is a space
    assert "p { margin" not in book.chapter(1).text and "ignored" not in book.chapter(1).text


def test_epub_titles_fall_back_to_the_heading_and_split_files_join(tmp_path):
    chapters = [("", "First Heading", ["One."]), ("Named", "Second", ["Two."]),
                ("", None, ["Still chapter two."])]
    book = read_book(write_epub(tmp_path / "b.epub", chapters))
    assert [c.title for c in book.chapters] == ["First Heading", "Named"]
    assert book.chapter(2).paragraphs == ("Second", "Two.", "Still chapter two.")


def test_epub_markup_that_is_not_read(tmp_path):
    extra = ("<p>Kept<span epub:type='pagebreak' title='7'>7</span> text<a epub:type='noteref'"
             " href='#n1'>1</a>.</p><p>Ruby <ruby>漢<rt>kan</rt></ruby> and<br/>a break.</p>"
             "<noscript><img src='x'></noscript><script>var x = 1;</script><p>Last.</p>")
    (chapter,) = read_book(write_epub(tmp_path / "m.epub", [("Only", "Heading", [])],
                                      tail=extra)).chapters
    assert chapter.paragraphs == ("Heading", "Kept text.", "Ruby 漢 and", "a break.", "Last.")


def test_an_empty_document_is_skipped_with_a_note(tmp_path):
    chapters = [THREE[0], ("Part Two", "Part Two", []), THREE[1]]
    book = read_book(write_epub(tmp_path / "e.epub", chapters))
    assert [c.title for c in book.chapters] == ["The Harbour", "The Lighthouse"]
    assert book.notes == ("'Part Two' has no text besides its heading: skipped",)


@pytest.mark.parametrize("line, heading", [
    ("Chapter 1", True), ("CHAPTER III. THE RETURN", True), ("Chapter Twenty-One", True),
    ("Chapter 4 The Boy Who Lived", True), ("Part Two: The Sea", True), ("Prologue", True),
    ("Epilogue — Ten Years On", True), ("XII", True), ("12.", True), ("第三章 回家", True),
    ("Part of me wanted to stay.", False), ("Introduction to the house was brief.", False),
    ("Mild", False), ("Book reviews", False), ("Chapter 1 " + "X" * 80, False),
    ("Chapter 1 is where it began.", False), ("Chapter 2 The End.", False),
    ("Chapter 5: What Now?", True),
])
def test_txt_heading_rule(line, heading):
    assert is_heading(line) is heading


def test_txt_chapters_at_standalone_headings(tmp_path):
    path = tmp_path / "tale_of_two.txt"
    path.write_text("A foreword line\nthat wraps.\n\nChapter 1\n\nIt was the best of times.\n"
                    "It was the worst.\n\nChapter 1 is not a heading inside a paragraph.\n\n"
                    "PART TWO\n\nCHAPTER II. THE END\n\nDone.\n", encoding="utf-8")
    book = read_book(path)
    assert book.title == "tale of two" and book.author is None
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("tale of two", ("A foreword line that wraps.",)),
        ("Chapter 1", ("Chapter 1", "It was the best of times. It was the worst.",
                       "Chapter 1 is not a heading inside a paragraph.")),
        ("CHAPTER II. THE END", ("CHAPTER II. THE END", "Done."))]
    assert book.notes == ("'PART TWO' has no text besides its heading: skipped",)
    assert read_book(path, title="Given", author="Someone").title == "Given"


def test_markdown_headings_front_matter_and_markup(tmp_path):
    path = tmp_path / "sea.md"
    path.write_text("---\ntitle: \"The Sea\"\nauthor: Ann Writer\n---\n# The Sea\n\n"
                    "## One\n\nA *bold* [link](http://x) ![pic](p.png) snake_case `code`.\n\n"
                    "```\nnot = read()\n```\n\n### A section\n\n- item one\n- item two\n\n"
                    "Two\n---\n\n> Quoted &amp; done.\n", encoding="utf-8")
    book = read_book(path)
    assert (book.title, book.author) == ("The Sea", "Ann Writer")
    assert [(c.title, c.paragraphs) for c in book.chapters] == [
        ("One", ("One", "A bold link snake_case code.", "A section", "item one item two")),
        ("Two", ("Two", "Quoted & done."))]
    assert book.notes == ()  # the title heading is the book's title, not an empty chapter
    assert markdown_inline("__strong__ and _em_ and ~~gone~~") == "strong and em and gone"


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"PK\x03\x04 not really a zip"), "not a readable EPUB: not a zip"),
    (lambda p: zipfile.ZipFile(p, "w").writestr("mimetype", "application/epub+zip"),
     "META-INF/container.xml is missing"),
    (lambda p: write_epub(p, encryption=encryption_xml("OEBPS/text/chap1.xhtml")),
     "is DRM-protected: META-INF/encryption.xml encrypts OEBPS/text/chap1.xhtml"),
    (lambda p: write_epub(p, [("A", None, []), ("B", "Heading only", [])]), "has no text to read"),
])
def test_bad_epubs_are_one_input_error(tmp_path, make, words):
    path = tmp_path / "bad.epub"
    make(path)
    with pytest.raises(InputError) as caught:
        read_book(path)
    assert words in str(caught.value) and caught.value.exit_code == EXIT_INPUT
    assert "\n" not in str(caught.value)


def test_font_obfuscation_is_not_drm(tmp_path):
    path = write_epub(tmp_path / "fonts.epub", encryption=encryption_xml(
        "OEBPS/fonts/serif.otf", "http://www.idpf.org/2008/embedding"))
    assert len(read_book(path).chapters) == 3


@pytest.mark.parametrize("name, text, words", [
    ("blank.txt", "\n \n\t\n", "blank.txt has no text to read"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), "latin1.txt is not UTF-8 text"),
    ("book.pdf", "x", "book.pdf: not a book file; give a .txt, .md or .epub file"),
])
def test_bad_text_files(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    with pytest.raises(InputError, match=words):
        read_book(path)
    with pytest.raises(InputError, match="book not found"):
        read_book(tmp_path / "absent.epub")
