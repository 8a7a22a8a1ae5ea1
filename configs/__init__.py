"""The built-in run profiles (`--config NAME`), shipped in the wheel as `mimo_tts.configs`."""
