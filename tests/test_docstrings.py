"""The package's prose names only modules that exist: every `name.py` (a file beside the module,
in the package, or at the repository's top) and every `mimo_tts.x.y` dotted path (a module, or a
name defined in one) quoted in the source. Moves leave stale names behind; this catches them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mimo_tts"
FILE = re.compile(r"`([\w./]+\.py)\b")
DOTTED = re.compile(r"`(mimo_tts(?:\.\w+)+)")
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _file_exists(name: str, source: Path) -> bool:
    places = [source.parent, PACKAGE, ROOT, *[p for p in PACKAGE.iterdir() if p.is_dir()]]
    return any((place / name).is_file() for place in places)


def _module_file(parts: list[str]) -> Path | None:
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted_exists(dotted: str) -> bool:
    """A module of the package, or a name a module defines or imports (read, not imported)."""
    parts = dotted.split(".")
    if parts[:2] == ["mimo_tts", "configs"]:
        return (ROOT / "configs").is_dir()
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        if cut == len(parts):
            return True
        name = parts[cut]
        return re.search(rf"^\s*(def|class) {name}\b|^\s*{name}\b.*=|^\s+{name},?\s*$|"
                         rf"import .*\b{name}\b|\"{name}\"", module.read_text(encoding="utf-8"),
                         re.MULTILINE) is not None
    return False


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_modules_exist(source):
    text = source.read_text(encoding="utf-8")
    missing = sorted({m for m in FILE.findall(text) if not _file_exists(m, source)})
    missing += sorted({m for m in DOTTED.findall(text) if not _dotted_exists(m)})
    assert not missing, f"{source.relative_to(ROOT)} names what does not exist: {missing}"
