"""The Markdown inline patterns and ATX heading rule as they were before they were made linear
(quadratic in the worst case): the oracle `test_read_linear.py` compares the new ones with."""

from __future__ import annotations

import html
import re

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*")
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
    for pattern, replacement in _INLINE:
        text = pattern.sub(replacement, text)
    return html.unescape(text)


def atx_heading(line: str) -> tuple[int, str] | None:
    heading = _ATX.fullmatch(line)
    return None if heading is None else (len(heading[1]), heading[2] or "")


def drop_comments(text: str) -> str:
    return re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
