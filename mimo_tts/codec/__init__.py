"""Stage-1 codec: the MiMo-Audio audio tokenizer (audio to RVQ codes and codes to audio)."""

from mimo_tts.codec.config import CodecConfig
from mimo_tts.codec.incremental import IncrementalDecoder
from mimo_tts.codec.load import load_audio_tokenizer
from mimo_tts.codec.service import TokenizerService
from mimo_tts.codec.streaming import StreamingDecoder
from mimo_tts.codec.tokenizer import AudioTokenizer

__all__ = [
    "AudioTokenizer",
    "CodecConfig",
    "IncrementalDecoder",
    "StreamingDecoder",
    "TokenizerService",
    "load_audio_tokenizer",
]
