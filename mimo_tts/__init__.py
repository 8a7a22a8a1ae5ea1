"""mimo-tts: an offline text-to-speech runner for MiMo-Audio.

The library face (whisper-style: one import, one call), loaded lazily so that `import mimo_tts`
and the CLI's `--help` stay torch-free:

    import mimo_tts
    tts = mimo_tts.load("tiny")                   # or a checkpoint directory / HF id
    audio = tts.synthesize("Hello from MiMo.")    # Audio: .samples float32, .sample_rate
"""

__version__ = "0.1.0"
__all__ = ["Audio", "AudioChunk", "MiMoTTS", "SynthesisOptions", "load"]

_FACE = {"load": "mimo_tts.synth", "MiMoTTS": "mimo_tts.synth", "Audio": "mimo_tts.synth",
         "AudioChunk": "mimo_tts.synth", "SynthesisOptions": "mimo_tts.options"}


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module `__getattr__`: each name in `exports` (name -> defining module) is
    imported on first use, so importing the package itself stays cheap."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__


__getattr__ = lazy_exports("mimo_tts", _FACE)
