"""The MiMo text tokenizer: byte-level BPE from `tokenizer.json` plus the MiMo special tokens.

Every special-token id is resolved by name from the checkpoint's own tokenizer (spec §5): the
published ids (151643, 151667, ...) differ from the tiny fixtures' and between variants.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mimo_tts.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")

# SpecialTokens field -> token string (spec §5). eos/pad come from tokenizer_config.json.
SPECIAL_TOKEN_NAMES = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "sosp": "<|sosp|>",
    "eosp": "<|eosp|>",
    "empty": "<|empty|>",
    "sostm": "<|sostm|>",
    "eostm": "<|eostm|>",
    "eot": "<|eot|>",
    "think": "<think>",
    "end_think": "</think>",
}


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens the prompts, the generator and the extractor use (resolved by name)."""

    endoftext: int
    im_start: int
    im_end: int
    sosp: int
    eosp: int
    empty: int
    sostm: int
    eostm: int
    eot: int
    think: int
    end_think: int
    eos: int
    pad: int


def _token_content(value) -> str | None:
    """A token entry of tokenizer_config.json: a plain string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_named_tokens(directory: Path) -> dict[str, str]:
    """eos_token / pad_token strings, tokenizer_config.json taking precedence over the map."""
    found: dict[str, str] = {}
    for name in reversed(CONFIG_FILES):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"unreadable {path}: {exc}") from None
        for key in ("eos_token", "pad_token"):
            content = _token_content(data.get(key))
            if content is not None:
                found[key] = content
    return found


class TextTokenizer:
    """Encode/decode text and expose the MiMo special-token ids of one checkpoint."""

    def __init__(self, tokenizer, special_by_name: dict[str, str], where: str):
        self._tok = tokenizer
        self._where = where
        self._len = tokenizer.get_vocab_size(with_added_tokens=True)
        names = SPECIAL_TOKEN_NAMES.values()
        missing = [tok for tok in names if tokenizer.token_to_id(tok) is None]
        if missing:
            raise CheckpointError(
                f"text tokenizer {where} lacks MiMo special token(s): {', '.join(missing)}"
            )
        ids = {field: self.token_id(tok) for field, tok in SPECIAL_TOKEN_NAMES.items()}
        if "eos_token" not in special_by_name:
            raise CheckpointError(f"no eos_token in {' or '.join(CONFIG_FILES)} of {where}")
        ids["eos"] = self.token_id(special_by_name["eos_token"])
        # Qwen2 tokenizers pad with <|endoftext|> when the config names no pad token.
        pad = special_by_name.get("pad_token", SPECIAL_TOKEN_NAMES["endoftext"])
        ids["pad"] = self.token_id(pad)
        self.special = SpecialTokens(**ids)

    @classmethod
    def from_dir(cls, path) -> TextTokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json` for eos/pad) from a checkpoint dir."""
        from tokenizers import Tokenizer

        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"tokenizer directory not found: {directory}")
        file = directory / TOKENIZER_FILE
        if not file.is_file():
            raise CheckpointError(f"missing {TOKENIZER_FILE} in {directory}")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust binding raises a bare Exception on parse errors
            raise CheckpointError(f"unreadable {file}: {exc}") from None
        return cls(tokenizer, _read_named_tokens(directory), str(directory))

    def encode(self, text: str) -> list[int]:
        """Token ids of one text segment, without added special tokens or truncation (spec §6.1)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids outside the tokenizer (LM vocab padding, negatives) are dropped."""
        kept = [int(i) for i in ids if 0 <= int(i) < self._len]
        return self._tok.decode(kept, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """Id of a token string; a CheckpointError if this tokenizer lacks it."""
        found = self._tok.token_to_id(token)
        if found is None:
            raise CheckpointError(f"text tokenizer {self._where} has no token {token!r}")
        return int(found)

    def token_string(self, token_id: int) -> str | None:
        """The vocabulary string of an id (None beyond the tokenizer)."""
        return self._tok.id_to_token(int(token_id)) if 0 <= int(token_id) < self._len else None

    def __len__(self) -> int:
        return self._len
