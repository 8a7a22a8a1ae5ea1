"""EPUB (2 and 3) -> sections: the standard library's `zipfile`, `xml.etree` for the package
files (container, OPF, NCX, encryption) and `html.parser` for the XHTML text.

- One chapter per spine document, in spine order. Left out: the navigation document, cover
  pages (the guide's or landmarks' `cover`, `epub:type="cover"`, or `cover` in the file name
  or manifest id), documents marked `linear="no"`, and documents with no text (a note each).
- A document's title is its first entry in the navigation (`nav.xhtml`'s table of contents,
  else `toc.ncx`), else its first heading, else its `<title>`. A document that the navigation
  does not name and that has no heading continues the chapter before it (a chapter split over
  files).
- Text: paragraphs from block elements (`p`, `div`, headings, `li`, `br`, ...); scripts,
  styles, ruby annotations, page-break markers and footnote references are not read.
- A book whose `META-INF/encryption.xml` encrypts anything but fonts (font obfuscation is not
  DRM) is DRM-protected; that, a file that is not a zip archive, or one missing its container
  or package document, is an InputError (exit 9), before anything is written.
- Limits (a zip bomb is refused before it is unpacked, also by `--list`): at most
  `MAX_ENTRIES` members, read from the archive's end record before `zipfile` lists them; a
  document (a member that is read: package files, XHTML) unpacks to at most
  `MAX_MEMBER_BYTES`, and past 1 MiB to at most `MAX_RATIO` times its packed size; the
  documents read unpack to at most `MAX_UNPACKED_BYTES` together (a spine naming one document
  many times counts it each time). Images, fonts and styles are never unpacked. Each is an
  InputError (exit 9) naming the member and the limit.
"""

from __future__ import annotations

import posixpath
import re
import xml.etree.ElementTree as ET
import zipfile
import zlib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

from mimo_tts.book.read import Section, plain
from mimo_tts.errors import InputError

CONTAINER = "META-INF/container.xml"
ENCRYPTION = "META-INF/encryption.xml"
# Font obfuscation (IDPF's and Adobe's) hides fonts only: the text stays readable.
FONT_OBFUSCATION = frozenset({"http://www.idpf.org/2008/embedding",
                              "http://ns.adobe.com/pdf/enc#RC"})
MAX_ENTRIES = 10_000  # members of the archive (a large illustrated book has a few thousand)
MAX_CENTRAL_BYTES = 16 * 2**20  # the archive's list of members, as its end record sizes it
MAX_MEMBER_BYTES = 32 * 2**20  # one document unpacked (a whole novel in one file: about 5 MiB)
MAX_UNPACKED_BYTES = 64 * 2**20  # every document read, unpacked, together
MAX_RATIO = 100  # unpacked : packed, for a document past RATIO_FLOOR (text deflates 3-10:1)
RATIO_FLOOR = 2**20
BLOCKS = frozenset("address article aside blockquote body br dd div dl dt figcaption figure "
                   "footer h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section table td "
                   "th tr ul".split())
HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
SKIPPED = frozenset("head script style rt rp svg math template noscript".split())
VOID = frozenset("area base br col embed hr img input link meta source track wbr".split())
COVER_NAME = re.compile(r"(?<![a-z])cover")  # cover.xhtml, id="coverpage"; not "discovery"
# epub:type / role values whose element is not read (markers and note references)
UNREAD = re.compile(r"\b(?:doc-)?(?:pagebreak|noteref|footnote|endnote|rearnote|annoref)\b")


class _Corrupt(Exception):
    """A structural problem, reported as "NAME is not a readable EPUB: ..."."""


class _TooBig(Exception):
    """Past one of the limits, reported as "NAME is refused: ..."."""


def read_epub(path: Path) -> tuple[str | None, str | None, list[Section]]:
    """(title, author, sections) of an EPUB file (module docstring)."""
    try:
        _check_directory(path)
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise InputError(f"{path.name} is not a readable EPUB: not a zip archive ({exc})"
                         ) from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except _TooBig as exc:
        raise InputError(f"{path.name} is refused: {exc}") from None
    try:
        with archive:
            if len(archive.infolist()) > MAX_ENTRIES:  # the end record undercounted them
                raise _TooBig(f"it holds {len(archive.infolist())} files; an EPUB may hold at "
                              f"most {MAX_ENTRIES}")
            book = _Archive(archive)
            _refuse_encrypted(book, path.name)
            return _Package(book).sections()
    except _Corrupt as exc:
        raise InputError(f"{path.name} is not a readable EPUB: {exc}") from None
    except _TooBig as exc:
        raise InputError(f"{path.name} is refused: {exc}") from None


_END = b"PK\x05\x06"  # the end of central directory record (APPNOTE 4.3.16)
_END64 = b"PK\x06\x06"  # its zip64 form, found through the locator before the end record
_LOCATOR64 = b"PK\x06\x07"


def _check_directory(path: Path) -> None:
    """Refuse an archive whose end record counts more than `MAX_ENTRIES` members or a list of
    them past `MAX_CENTRAL_BYTES`, before `zipfile` builds an object for each. Without an end
    record nothing is said here (`zipfile` then says the file is not a zip archive)."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - 22 - 0xFFFF))  # the record, then a comment of up to 64 KiB
        tail = handle.read()
        at = tail.rfind(_END)
        if at < 0 or len(tail) < at + 22:
            return
        count = int.from_bytes(tail[at + 10:at + 12], "little")
        listed = int.from_bytes(tail[at + 12:at + 16], "little")
        if (count == 0xFFFF or listed == 0xFFFFFFFF) and tail[at - 20:at - 16] == _LOCATOR64:
            handle.seek(int.from_bytes(tail[at - 12:at - 4], "little"))
            record = handle.read(56)
            if record[:4] == _END64 and len(record) == 56:
                count = int.from_bytes(record[32:40], "little")
                listed = int.from_bytes(record[40:48], "little")
    if count > MAX_ENTRIES:
        raise _TooBig(f"it holds {count} files; an EPUB may hold at most {MAX_ENTRIES}")
    if listed > MAX_CENTRAL_BYTES:
        raise _TooBig(f"its list of files is {listed / 2**20:.1f} MiB; an EPUB's may be at most "
                      f"{MAX_CENTRAL_BYTES >> 20} MiB")


class _Archive:
    """The book's zip archive, its documents unpacked within the limits (module docstring)."""

    def __init__(self, archive: zipfile.ZipFile):
        self.zip = archive
        self.names = frozenset(archive.namelist())
        self.unpacked = 0  # bytes of the documents read so far

    def read(self, name: str) -> bytes:
        try:
            info = self.zip.getinfo(name)
        except KeyError:
            raise _Corrupt(f"{name} is missing") from None
        size, packed = info.file_size, max(info.compress_size, 1)
        if size > MAX_MEMBER_BYTES:
            raise _TooBig(f"{name} unpacks to {size / 2**20:.1f} MiB; a document may unpack "
                          f"to at most {MAX_MEMBER_BYTES >> 20} MiB")
        if size > RATIO_FLOOR and size > MAX_RATIO * packed:
            raise _TooBig(f"{name} unpacks to {size / 2**20:.1f} MiB from {packed / 2**10:.1f} "
                          f"KiB ({size // packed}:1); a document past "
                          f"{RATIO_FLOOR >> 20} MiB may unpack to at most {MAX_RATIO}:1")
        if self.unpacked + size > MAX_UNPACKED_BYTES:
            raise _TooBig(f"its documents unpack to more than {MAX_UNPACKED_BYTES >> 20} MiB "
                          f"together (at {name})")
        self.unpacked += size
        try:
            return self.zip.read(info)  # at most file_size bytes: zipfile stops there
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError,
                RuntimeError) as exc:
            raise _Corrupt(f"{name} cannot be unpacked ({exc})") from None


def _local(tag) -> str:
    """An element's name without its namespace."""
    return tag.rsplit("}", 1)[-1] if isinstance(tag, str) else ""


def _all(root, name: str) -> list:
    return [e for e in root.iter() if _local(e.tag) == name]


def _xml(archive: _Archive, name: str):
    try:
        return ET.fromstring(archive.read(name))
    except ET.ParseError as exc:
        raise _Corrupt(f"{name} is not well-formed XML ({exc})") from None


def _refuse_encrypted(archive: _Archive, name: str) -> None:
    """DRM: `encryption.xml` naming a resource encrypted by anything but font obfuscation."""
    if ENCRYPTION not in archive.names:
        return
    try:
        root = _xml(archive, ENCRYPTION)
    except _Corrupt:  # unreadable encryption data: nothing here can be trusted to be text
        raise InputError(f"{name} is DRM-protected or damaged: {ENCRYPTION} cannot be read"
                         ) from None
    encrypted = []
    for data in _all(root, "EncryptedData"):
        methods = [m.get("Algorithm", "") for m in _all(data, "EncryptionMethod")]
        if not methods or any(m not in FONT_OBFUSCATION for m in methods):
            refs = [r.get("URI", "?") for r in _all(data, "CipherReference")]
            encrypted.extend(refs or ["?"])
    if encrypted:
        more = f" and {len(encrypted) - 1} more" if len(encrypted) > 1 else ""
        raise InputError(f"{name} is DRM-protected: {ENCRYPTION} encrypts {encrypted[0]}{more}; "
                         "only books without DRM can be read")


class _Package:
    """The package document (OPF): metadata, manifest, spine, and the navigation's titles."""

    def __init__(self, archive: _Archive):
        self.archive = archive
        rootfiles = [r.get("full-path") for r in _all(_xml(archive, CONTAINER), "rootfile")]
        if not rootfiles or not rootfiles[0]:
            raise _Corrupt(f"{CONTAINER} names no package document")
        self.opf = rootfiles[0]
        self.root = _xml(archive, self.opf)
        self.items = {i.get("id"): i for i in _all(self.root, "item") if i.get("href")}

    def href(self, item) -> str:
        """A manifest item's path inside the archive."""
        return self.resolve(self.opf, item.get("href"))

    @staticmethod
    def resolve(base: str, href: str) -> str:
        """`href` (relative to the file `base`, maybe with a fragment) as an archive path."""
        path = unquote(href.split("#", 1)[0])
        return posixpath.normpath(posixpath.join(posixpath.dirname(base), path)).lstrip("/")

    def metadata(self, name: str) -> str | None:
        found = [plain("".join(e.itertext())) for e in _all(self.root, name)]
        return next((text for text in found if text), None)

    def sections(self) -> tuple[str | None, str | None, list[Section]]:
        spine = [r for r in _all(self.root, "itemref") if r.get("linear", "yes") != "no"]
        if not spine:
            raise _Corrupt(f"{self.opf} has an empty spine")
        nav = self.nav_item()
        titles, covers = self.navigation(nav)
        covers |= {self.resolve(self.opf, r.get("href", "")) for r in _all(self.root, "reference")
                   if (r.get("type") or "").lower() == "cover"}
        sections: list[Section] = []
        for ref in spine:
            item = self.items.get(ref.get("idref"))
            if item is None:
                raise _Corrupt(f"the spine names {ref.get('idref')!r}, which the manifest lacks")
            path = self.href(item)
            if item is nav or path in covers or COVER_NAME.search(f"{item.get('id')} {path}"
                                                                 .lower()):
                continue
            document = _Document.parse(self.archive.read(path))
            if document.cover:
                continue
            title = titles.get(path) or document.heading
            if title is None and titles and sections:  # a chapter split over files
                section = sections[-1]
            else:
                section = Section(title or document.title)
                sections.append(section)
            for text, heading in document.paragraphs:
                section.add(text, heading)
        return self.metadata("title"), self.metadata("creator"), sections

    def nav_item(self):
        return next((i for i in self.items.values()
                     if "nav" in (i.get("properties") or "").split()), None)

    def navigation(self, nav) -> tuple[dict[str, str], set[str]]:
        """{document path: its first title} from the EPUB 3 navigation document, else from the
        NCX; and the documents its landmarks call the cover."""
        titles: dict[str, str] = {}
        covers: set[str] = set()
        if nav is not None:
            base = self.href(nav)
            links = _Document.parse(self.archive.read(base)).links
            for kind, href, text in links:
                target = self.resolve(base, href)
                if kind == "toc" and text:
                    titles.setdefault(target, text)
                elif kind == "landmarks:cover":
                    covers.add(target)
        if not titles:
            ncx = self.items.get(next((s.get("toc") for s in _all(self.root, "spine")), None))
            ncx = ncx or next((i for i in self.items.values()
                               if i.get("media-type") == "application/x-dtbncx+xml"), None)
            if ncx is not None:
                base = self.href(ncx)
                for point in _all(_xml(self.archive, base), "navPoint"):
                    label = next((plain("".join(t.itertext())) for t in _all(point, "text")), "")
                    content = next((c.get("src") for c in _all(point, "content")), None)
                    if label and content:
                        titles.setdefault(self.resolve(base, content), label)
        return titles, covers


class _Document(HTMLParser):
    """One XHTML document as text: paragraphs (text, is_heading), its first heading, its
    `<title>`, whether it declares itself a cover, and (in a navigation document) its links
    by the kind of `nav` they sit in."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[tuple[str, bool]] = []
        self.links: list[tuple[str, str, str]] = []
        self.heading: str | None = None
        self.title: str | None = None
        self.cover = False
        self._buffer: list[str] = []
        self._skip: list[str] = []  # the elements being left out, innermost last
        self._heading: str | None = None  # the open h1-h6
        self._in_title = False
        self._nav: list[str] = []  # the kinds of the nav elements we are in
        self._link: list | None = None  # [kind, href, text parts] of the open <a>

    @classmethod
    def parse(cls, data: bytes) -> _Document:
        document = cls()
        document.feed(_decode(data))
        document.close()
        document._end_paragraph()
        return document

    def handle_starttag(self, tag, attrs):
        attrs = {k.rsplit(":", 1)[-1]: v or "" for k, v in attrs}  # epub:type -> type
        kind = f"{attrs.get('type', '')} {attrs.get('role', '')}"
        self._in_title = self._in_title or tag == "title"
        if self._skip or tag in SKIPPED or UNREAD.search(kind):
            if tag not in VOID:  # a void element has no end tag to wait for
                self._skip.append(tag)
            return
        if tag in ("body", "section") and re.search(r"\bcover\b", kind):
            self.cover = True
        if tag in BLOCKS and self._heading is None:
            self._end_paragraph()
            self._heading = tag if tag in HEADINGS else None
        elif tag in BLOCKS:  # a line break inside a heading
            self._buffer.append(" ")
        if tag == "nav":
            self._nav.append(attrs.get("type", "").split(" ")[0] or "nav")
        if tag == "a" and self._nav:
            kind = self._nav[-1]
            if kind == "landmarks":
                kind += ":" + attrs.get("type", "").split(" ")[0]
            self._link = [kind, attrs.get("href", ""), []]

    def handle_endtag(self, tag):
        self._in_title = self._in_title and tag != "title"
        if self._skip:
            if tag in self._skip:  # unclosed elements inside it close with it
                del self._skip[len(self._skip) - 1 - self._skip[::-1].index(tag):]
            return
        if tag == "a" and self._link is not None:
            kind, href, parts = self._link
            self.links.append((kind, href, plain("".join(parts))))
            self._link = None
        if tag in BLOCKS and (self._heading is None or tag == self._heading):
            self._end_paragraph()
        if tag == "nav" and self._nav:
            self._nav.pop()

    def handle_data(self, data):
        if self._in_title:
            self.title = plain(f"{self.title or ''} {data}") or None
        if self._skip:
            return
        self._buffer.append(data)
        if self._link is not None:
            self._link[2].append(data)

    def _end_paragraph(self):
        text = plain("".join(self._buffer))
        self._buffer.clear()
        if text:
            self.paragraphs.append((text, self._heading is not None))
            if self._heading is not None and self.heading is None:
                self.heading = text
        self._heading = None


def _decode(data: bytes) -> str:
    """XHTML bytes as text: the XML declaration's encoding, else UTF-8 (bad bytes replaced)."""
    match = re.match(rb"^\s*<\?xml[^>]*encoding=[\"']([A-Za-z0-9._-]+)", data)
    encoding = match[1].decode("ascii") if match else "utf-8"
    try:
        return data.decode(encoding, errors="replace").removeprefix("\ufeff")
    except LookupError:
        return data.decode("utf-8", errors="replace").removeprefix("\ufeff")
