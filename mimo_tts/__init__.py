"""mimo-tts: an offline text-to-speech runner for MiMo-Audio.

The library face (whisper-style: one import, one call), loaded lazily so that `import mimo_tts`
and the CLI's `--help` stay torch-free:

    import mimo_tts
    tts = mimo_tts.load("tiny")                   # or a checkpoint directory / HF id
    audio = tts.synthesize("Hello from MiMo.")    # Audio: .samples float32, .sample_rate
"""

from mimo_tts._lazy import lazy_exports

__version__ = "0.1.0"
__all__ = ["Audio", "AudioChunk", "MiMoTTS", "SynthesisOptions", "load"]

_LIBRARY = "mimo_tts.synthesis.synthesizer"
_FACE = {"load": _LIBRARY, "MiMoTTS": _LIBRARY, "Audio": _LIBRARY, "AudioChunk": _LIBRARY,
         "SynthesisOptions": "mimo_tts.synthesis.options"}

__getattr__ = lazy_exports("mimo_tts", _FACE)
