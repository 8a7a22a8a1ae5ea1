"""Small books the tests write themselves: an EPUB 3 built with zipfile (mimetype, container,
OPF with its spine, nav.xhtml, a cover page, chapter XHTML), and the same text as .txt and .md.

`THREE` is the book of the issue's checks: three chapters, a cover and a navigation page. Each
chapter is a heading and two sentences, so the book has 9 sentences (pieces, cues).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

TITLE, AUTHOR = "The Small Sea", "Ada Writer"
THREE = [  # (title in the navigation, heading, paragraphs)
    ("The Harbour", "Chapter 1: The Harbour",
     ["The boats came in at dawn. Gulls followed them &amp; cried."]),
    ("The Lighthouse", "Chapter 2: The Lighthouse",
     ["The keeper climbed the stairs.", "His lamp&#160;burned all night."]),
    ("The Return", "Chapter 3: The Return",
     ["Spring brought the ships home. Nobody was late."]),
]
SENTENCES = 9  # 3 headings + 6 sentences

CONTAINER = """<?xml version="1.0" encoding="UTF-8"?>
<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">
  <rootfiles><rootfile full-path="OEBPS/content.opf"
    media-type="application/oebps-package+xml"/></rootfiles>
</container>"""


def chapter_xhtml(heading: str | None, paragraphs: list[str], extra: str = "") -> str:
    body = (f"<h1>{heading}</h1>" if heading else "") + "".join(
        f"<p>{p}</p>" for p in paragraphs)
    return ("<?xml version='1.0' encoding='utf-8'?>\n<!DOCTYPE html>\n"
            "<html xmlns='http://www.w3.org/1999/xhtml' "
            "xmlns:epub='http://www.idpf.org/2007/ops'><head><title>ignored</title>"
            "<style>p { margin: 0 }</style></head>"
            f"<body>{body}{extra}</body></html>")


def write_epub(path: Path, chapters=THREE, *, title=TITLE, author=AUTHOR,
               encryption: str | None = None, tail: str = "") -> Path:
    """An EPUB 3 at `path`: cover.xhtml, nav.xhtml (first in the spine, as some books have
    it), then one document per chapter (its body ending in `tail`); `encryption` is
    META-INF/encryption.xml's text."""
    files = [(f"chap{i}.xhtml", chapter_xhtml(heading, paragraphs, tail))
             for i, (_, heading, paragraphs) in enumerate(chapters, 1)]
    nav_links = "".join(f"<li><a href='text/chap{i}.xhtml#start'>{name}</a></li>"
                        for i, (name, _, _) in enumerate(chapters, 1) if name)
    nav = ("<?xml version='1.0' encoding='utf-8'?><html xmlns='http://www.w3.org/1999/xhtml' "
           "xmlns:epub='http://www.idpf.org/2007/ops'><head><title>Contents</title></head><body>"
           f"<nav epub:type='toc'><h1>Contents</h1><ol>{nav_links}</ol></nav>"
           "<nav epub:type='landmarks'><ol><li><a epub:type='cover' href='text/cover.xhtml'>"
           "Cover</a></li></ol></nav></body></html>")
    cover = chapter_xhtml(None, [], "<div><img src='../cover.png' alt='The cover'/></div>")
    manifest = "".join(f"<item id='c{i}' href='text/{name}' media-type='application/xhtml+xml'/>"
                       for i, (name, _) in enumerate(files, 1))
    spine = "".join(f"<itemref idref='c{i}'/>" for i in range(1, len(files) + 1))
    opf = f"""<?xml version="1.0" encoding="UTF-8"?>
<package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="id">
  <metadata xmlns:dc="http://purl.org/dc/elements/1.1/">
    <dc:identifier id="id">urn:uuid:0</dc:identifier><dc:title>{title}</dc:title>
    <dc:creator>{author}</dc:creator><dc:language>en</dc:language>
  </metadata>
  <manifest>
    <item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>
    <item id="titlepage" href="text/cover.xhtml" media-type="application/xhtml+xml"/>
    {manifest}
  </manifest>
  <spine><itemref idref="titlepage"/><itemref idref="nav"/>{spine}</spine>
</package>"""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        archive.writestr("META-INF/container.xml", CONTAINER)
        if encryption is not None:
            archive.writestr("META-INF/encryption.xml", encryption)
        archive.writestr("OEBPS/content.opf", opf)
        archive.writestr("OEBPS/nav.xhtml", nav)
        archive.writestr("OEBPS/text/cover.xhtml", cover)
        for name, text in files:
            archive.writestr(f"OEBPS/text/{name}", text, compress_type=zipfile.ZIP_DEFLATED)
    return path


def encryption_xml(uri: str, algorithm: str = "http://www.w3.org/2001/04/xmlenc#aes128-cbc"
                   ) -> str:
    return ("<encryption xmlns='urn:oasis:names:tc:opendocument:xmlns:container' "
            "xmlns:enc='http://www.w3.org/2001/04/xmlenc#'><enc:EncryptedData>"
            f"<enc:EncryptionMethod Algorithm='{algorithm}'/>"
            f"<enc:CipherData><enc:CipherReference URI='{uri}'/></enc:CipherData>"
            "</enc:EncryptedData></encryption>")


# `--list` of the three-chapter book `write_epub` writes (the CLI's and `table_lines`')
THREE_TABLE = [
    "The Small Sea by Ada Writer",
    "#  title           characters  minutes",
    "1  The Harbour             77      0.1",
    "2  The Lighthouse          81      0.1",
    "3  The Return              68      0.1",
    "   3 chapters             226      0.3",
]
