"""`mimo-tts serve`: the OpenAI-compatible speech server (protocol, app, worker)."""
