"""Issue 32 item 17: an EPUB has bounds on what it unpacks (members, ratio, each document, all
documents together), each a one-line InputError (exit 9) before anything is written, and
`--list` of a 600 KB zip bomb no longer unpacks 1.3 GB."""

from __future__ import annotations

import zipfile

import pytest

from mimo_tts.book import epub
from mimo_tts.book.read import read_book
from mimo_tts.errors import EXIT_INPUT, InputError
from tests.book.books import CONTAINER, chapter_xhtml, write_epub


def _epub(path, documents: dict[str, bytes], spine: list[str], compress=zipfile.ZIP_DEFLATED,
          extra: int = 0):
    """A minimal EPUB: `documents` (name -> XHTML) read in `spine` order, and `extra` empty
    files besides."""
    manifest = "".join(f"<item id='{n}' href='{n}' media-type='application/xhtml+xml'/>"
                       for n in documents)
    opf = ("<?xml version='1.0'?><package xmlns='http://www.idpf.org/2007/opf' version='3.0'>"
           "<metadata xmlns:dc='http://purl.org/dc/elements/1.1/'><dc:title>Bomb</dc:title>"
           f"</metadata><manifest>{manifest}</manifest><spine>"
           + "".join(f"<itemref idref='{n}'/>" for n in spine) + "</spine></package>")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        archive.writestr("META-INF/container.xml", CONTAINER)
        archive.writestr("OEBPS/content.opf", opf)
        for name, data in documents.items():
            archive.writestr(f"OEBPS/{name}", data, compress_type=compress,
                             compresslevel=9 if compress == zipfile.ZIP_DEFLATED else None)
        for i in range(extra):
            archive.writestr(f"OEBPS/images/{i}.png", b"")
    return path


def _document(mebibytes: float, word: str = "sea") -> bytes:
    paragraph = f"<p>{' '.join([word] * 200)}.</p>"
    count = int(mebibytes * 2**20) // len(paragraph)
    return chapter_xhtml("A chapter", [paragraph[3:-4]] * count).encode()


def _refusal(path) -> str:
    with pytest.raises(InputError) as caught:
        read_book(path)
    assert caught.value.exit_code == EXIT_INPUT and "\n" not in str(caught.value)
    return str(caught.value)


def test_a_zip_bomb_is_refused_by_its_ratio_before_it_is_unpacked(tmp_path):
    # 9 documents of 31 MiB each, deflated about 1000:1 (the hostile tester's 600 KB file)
    bomb = _document(31)
    path = _epub(tmp_path / "bomb.epub", {f"c{i}.xhtml": bomb for i in range(9)},
                 [f"c{i}.xhtml" for i in range(9)])
    assert path.stat().st_size < 2**20
    message = _refusal(path)
    assert message.startswith("bomb.epub is refused: OEBPS/c0.xhtml unpacks to 31.0 MiB from ")
    assert "a document past 1 MiB may unpack to at most 100:1" in message


def test_a_document_past_the_member_limit_is_refused(tmp_path):
    big = _document(epub.MAX_MEMBER_BYTES / 2**20 + 1)
    path = _epub(tmp_path / "big.epub", {"c.xhtml": big}, ["c.xhtml"], zipfile.ZIP_STORED)
    assert _refusal(path) == ("big.epub is refused: OEBPS/c.xhtml unpacks to 33.0 MiB; a "
                              "document may unpack to at most 32 MiB")


def test_documents_past_the_total_are_refused_even_one_named_many_times(tmp_path):
    # one stored 2 MiB document (ratio 1:1) that the spine names 40 times: 80 MiB to parse
    path = _epub(tmp_path / "spine.epub", {"c.xhtml": _document(2)}, ["c.xhtml"] * 40,
                 zipfile.ZIP_STORED)
    assert path.stat().st_size < 3 * 2**20
    assert _refusal(path) == ("spine.epub is refused: its documents unpack to more than 64 MiB "
                              "together (at OEBPS/c.xhtml)")


def test_an_archive_of_too_many_files_is_refused_before_they_are_listed(tmp_path):
    path = _epub(tmp_path / "many.epub", {"c.xhtml": _document(0.01)}, ["c.xhtml"],
                 extra=epub.MAX_ENTRIES)
    assert _refusal(path) == (
        "many.epub is refused: it holds 10004 files; an EPUB may hold at most 10000")


def test_an_end_record_that_undercounts_is_caught_after_listing(tmp_path):
    path = _epub(tmp_path / "liar.epub", {"c.xhtml": _document(0.01)}, ["c.xhtml"],
                 extra=epub.MAX_ENTRIES)
    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end + 8:end + 12] = (3).to_bytes(2, "little") * 2  # entries on disk, in total
    path.write_bytes(data)
    assert "it holds 10004 files; an EPUB may hold at most 10000" in _refusal(path)


def test_a_book_within_the_limits_reads_as_before(tmp_path):
    # a real book's documents: well inside every limit, deflated at an ordinary ratio
    path = write_epub(tmp_path / "fine.epub")
    assert [c.title for c in read_book(path).chapters] == ["The Harbour", "The Lighthouse",
                                                           "The Return"]
    legit = _epub(tmp_path / "long.epub", {f"c{i}.xhtml": _document(3, f"w{i}") for i in range(3)},
                  [f"c{i}.xhtml" for i in range(3)], zipfile.ZIP_STORED)
    assert len(read_book(legit).chapters) == 3
