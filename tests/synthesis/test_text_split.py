"""Issue 13 item 3: splitting long text never changes what is spoken.

Every piece is a slice of the text; the cuts fall only at sentence ends (whitespace after an
ASCII terminator, or CJK full stops), then at whitespace or commas, so decimals, abbreviations,
URLs, ellipses and quotes survive, and no space is added between CJK sentences.
"""

from __future__ import annotations

import re

import pytest

from mimo_tts.synthesis.text import split_text


def _check(text: str, limit: int) -> list[str]:
    pieces = split_text(text, limit)
    assert all(len(p) <= limit for p in pieces), pieces
    at = 0
    for piece in pieces:  # consecutive slices of the text, only whitespace between them
        found = text.index(piece, at)
        assert text[at:found].strip() == ""
        at = found + len(piece)
    assert text[at:].strip() == ""
    return pieces


NEWCOMER = ("The price went up by 3.5 percent at 5 p.m. yesterday, see www.example.com for "
            "details. Mr. Smith paid $3.50. Then he left.")


def test_the_newcomer_sentence_keeps_its_tokens():
    pieces = _check(NEWCOMER, 60)
    joined = " ".join(pieces)
    for token in ("3.5", "p.m.", "www.example.com", "$3.50", "Mr. Smith"):
        assert token in joined
    assert pieces[-1] == "Then he left."
    assert not any(p.endswith(("p.", "Mr.", "3.", "www.")) for p in pieces)


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("One two three. Four five six! Seven eight nine? Ten.", 20,
     ["One two three.", "Four five six!", "Seven eight nine?", "Ten."]),
    ("Pi is 3.14159 roughly. E.g. this one, i.e. that one. Done now.", 30,
     ["Pi is 3.14159 roughly.", "E.g. this one, i.e. that one.", "Done now."]),
    ('He said "Stop." Then she waited... and went home.', 20,
     ['He said "Stop."', "Then she waited...", "and went home."]),
    ("Visit https://example.com/a.b?c=1.2 today. Bye now.", 45,
     ["Visit https://example.com/a.b?c=1.2 today.", "Bye now."]),
    ("J. R. R. Tolkien wrote books. The end.", 30, ["J. R. R. Tolkien wrote books.", "The end."]),
])
def test_cuts_only_at_sentence_ends(text, limit, expected):
    assert _check(text, limit) == expected


def test_cjk_sentences_join_without_added_spaces():
    zh = "今天天气真好。我们一起去公园散步吧！你好吗？" * 3
    pieces = _check(zh, 20)
    assert "".join(pieces) == zh  # no space was there, none is added
    assert all(re.search(r"[。！？]$", p) for p in pieces)
    ja = "「こんにちは。」と彼は言った。今日は晴れです。"
    assert "".join(_check(ja, 12)) == ja


def test_long_sentences_cut_at_spaces_then_commas():
    words = " ".join(f"word{i}" for i in range(40))
    assert " ".join(_check(words, 25)) == words
    numbers = "1,000,000 and 2,500 items, " * 8
    pieces = _check(numbers.strip(), 40)
    assert all(not p.startswith(("000", "500")) for p in pieces)  # never inside "1,000"
    unbroken = "x" * 95
    assert "".join(_check(unbroken, 30)) == unbroken  # last resort: at the limit


def test_short_or_disabled():
    assert split_text("short", 300) == ["short"]
    assert split_text("x. " * 200, 0) == ["x. " * 200]
