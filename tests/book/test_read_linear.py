"""Issue 32 item 17: the Markdown inline patterns and heading rule in linear time, with the same
results as before, and a documented limit on a book file's size.

The new scanners were compared with the old patterns on random Markdown-ish texts (the commit
that made them linear holds that test and the old patterns as its oracle; both are gone since).
Lines that took the old patterns minutes (120 KB of `___a `: about 90 CPU-seconds) are read here
under a CPU-seconds cap two orders of magnitude above what the linear scanners need, in a
subprocess, so a quadratic reader is stopped by the kernel rather than by a clock in the test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mimo_tts.book import read
from mimo_tts.book.read import MAX_BOOK_BYTES, read_book
from mimo_tts.errors import InputError

ADVERSARIAL = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_CPU, (60, 60))
    from pathlib import Path
    from mimo_tts.book.read import read_book
    n = 120_000
    lines = {"underscores": "___a " * (n // 5), "stars": "*a " * (n // 3),
             "tildes": "~~a " * (n // 4), "brackets": "[" * n, "images": "![" * (n // 2),
             "links": "[a](" * (n // 4), "tags": "<a" * (n // 2), "autolinks": "<http:" * (n // 6),
             "comments": "<!--" * (n // 4), "heading": "# a" + " " * n + "b",
             "backticks": "`a " * (n // 3)}
    folder = Path(sys.argv[1])
    for name, line in lines.items():
        path = folder / f"{name.replace(' ', '-')}.md"
        path.write_text(f"# {name}\\n\\nSome text.\\n\\n{line}\\n", encoding="utf-8")
        assert read_book(path).chapters, name
    print("ok")
""")


def test_adversarial_120_kb_lines_read_in_linear_time(tmp_path):
    """Each 120 KB line in well under the 60 CPU-seconds cap (the old patterns: 4.9 s for
    20 KB of `___a `, growing with the square of the length)."""
    done = subprocess.run([sys.executable, "-c", ADVERSARIAL, str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("suffix", [".txt", ".md"])
def test_a_book_file_past_the_limit_is_refused_before_it_is_read(tmp_path, suffix):
    path = tmp_path / f"huge{suffix}"
    with open(path, "wb") as handle:  # sparse: no 64 MiB written
        handle.truncate(MAX_BOOK_BYTES + 1)
    with pytest.raises(InputError, match=rf"huge{suffix} is 64\.0 MiB; a book file may be at "
                                         r"most 64 MiB"):
        read_book(path)


def _plain_by_character(text: str) -> str:
    import unicodedata

    text = unicodedata.normalize("NFC", text)
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text
                   if unicodedata.category(c) not in ("Cf", "Cs", "Co"))
    return " ".join(text.split())


@settings(max_examples=2000, deadline=None)
@given(text=st.text(st.characters(), max_size=40))
def test_plain_translates_as_its_character_rule(text):
    """`plain` at C speed (`str.translate` with a per-character table) gives the per-character
    rule's text: 64 MiB of EPUB documents list in seconds, not minutes."""
    assert read.plain(text) == _plain_by_character(text)
