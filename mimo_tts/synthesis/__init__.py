"""The library: text -> Audio in memory, the same on every face (options, profiles, text,
audio, preflight, Stage-1, streaming, `MiMoTTS`)."""
