"""Stage-1 codec: the MiMo-Audio audio tokenizer (audio to RVQ codes and codes to audio).

Exports resolve lazily (as in `mimo_tts.lm`) so that `mimo_tts.codec.config` (no torch) stays
cheap to import for preflights.
"""

from __future__ import annotations

from mimo_tts._lazy import lazy_exports

_EXPORTS = {
    "AudioTokenizer": "mimo_tts.codec.tokenizer",
    "CodecConfig": "mimo_tts.codec.config",
    "IncrementalDecoder": "mimo_tts.codec.incremental",
    "StreamingDecoder": "mimo_tts.codec.streaming",
    "load_audio_tokenizer": "mimo_tts.codec.load",
    "push_streams": "mimo_tts.codec.streaming",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("mimo_tts.codec", _EXPORTS)
