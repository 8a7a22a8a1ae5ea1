"""Stage-1 codec: the MiMo-Audio audio tokenizer (audio to RVQ codes and codes to audio).

Exports resolve lazily (as in `mimo_tts.lm`) so that `mimo_tts.codec.config` (no torch) stays
cheap to import for preflights.
"""

from __future__ import annotations

_EXPORTS = {
    "AudioTokenizer": "mimo_tts.codec.tokenizer",
    "CodecConfig": "mimo_tts.codec.config",
    "IncrementalDecoder": "mimo_tts.codec.incremental",
    "StreamingDecoder": "mimo_tts.codec.streaming",
    "TokenizerService": "mimo_tts.codec.service",
    "load_audio_tokenizer": "mimo_tts.codec.load",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mimo_tts.codec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
