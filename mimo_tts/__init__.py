"""mimo-tts: an offline text-to-speech runner for MiMo-Audio.

The library face (whisper-style: one import, one call), loaded lazily so that `import mimo_tts`
and the CLI's `--help` stay torch-free:

    import mimo_tts
    tts = mimo_tts.load()               # the published 7B LM; or "tiny", a directory, an HF id
    audio = tts.synthesize("Hello.")    # Audio: .samples float32, .sample_rate
    tts.add_voice("me", "me.wav")       # kept by name (mimo_tts.VoiceStore)
    audio = tts.synthesize("Hi.", voice="me", captions=True)   # audio.cues: exact spans

Every failure is a `MimoTTSError` subclass carrying the CLI's exit code; a run that cannot fit
in memory raises `NotEnoughMemoryError` before anything is loaded.
"""

from mimo_tts.runtime import openmp

openmp.configure()  # before anything here imports torch (libgomp reads it once, at load)

from mimo_tts._lazy import lazy_exports  # noqa: E402
from mimo_tts._version import __version__  # noqa: E402, F401 (the package face)
from mimo_tts.errors import (  # noqa: E402
    AudioCheckError,
    CheckpointError,
    DeviceError,
    InputError,
    MimoTTSError,
    NoAudioError,
    NotEnoughMemoryError,
    OptionTypeError,
    OutputError,
    UsageError,
)

__all__ = ["Audio", "AudioChunk", "MiMoTTS", "SynthesisOptions", "VoiceStore", "load",
           "AudioCheckError", "CheckpointError", "DeviceError", "InputError", "MimoTTSError",
           "NoAudioError",
           "NotEnoughMemoryError", "OptionTypeError", "OutputError", "UsageError"]

_LIBRARY = "mimo_tts.synthesis.synthesizer"
_FACE = {"load": _LIBRARY, "MiMoTTS": _LIBRARY, "Audio": "mimo_tts.synthesis.speech",
         "AudioChunk": "mimo_tts.synthesis.speech",
         "SynthesisOptions": "mimo_tts.synthesis.options",
         "VoiceStore": "mimo_tts.synthesis.voices"}

__getattr__ = lazy_exports("mimo_tts", _FACE)
