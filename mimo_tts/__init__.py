"""mimo-tts: an offline text-to-speech runner for MiMo-Audio."""

__version__ = "0.1.0"
