"""The book's voice, read (`plan.book_voice` plans it): the book's first piece through the
batch runner into `book-voice.wav` in the book's folder, with its sidecar as `synth -o` writes
one, under the book's lock so shards starting together read it once. A voice there from the
same inputs is kept as it is (its mtime too: the pieces' resume keys hold its stamp)."""

from __future__ import annotations

from mimo_tts.batch.plan import run_synth
from mimo_tts.batch.runner import BatchRunner
from mimo_tts.book.assemble import BookLock
from mimo_tts.book.plan import BookVoice
from mimo_tts.errors import MimoTTSError


def read_voice(voice: BookVoice, log=None) -> bool:
    """Read the book's voice unless it is there from the same inputs: whether it was read."""
    voice.path.parent.mkdir(parents=True, exist_ok=True)
    with BookLock(voice.path.parent), BatchRunner(voice.plan.settings, log=log) as runner:
        (result,) = run_synth(runner, voice.plan.items, voice.plan.sink())
    if result.status == "error":  # the run fails with the piece's exit code
        error = MimoTTSError(f"the book's voice (its first piece, {voice.path.name}) could not "
                             f"be read: {result.error}; give --voice, --prompt-audio or "
                             "--voice-per-piece")
        error.exit_code = result.exit_code
        raise error
    return result.status == "ok"
