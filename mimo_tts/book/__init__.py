"""Books read aloud (`mimo-tts book`): `.txt`, `.md` and `.epub` -> chapters (`read.py`,
`epub.py`) -> one batch item per sentence (`plan.py`) -> chapter files, `book.m4b` (`m4b.py`,
the optional `book` extra), captions and `book.json` (`assemble.py`). A layer above `batch`:
the pieces run through the batch runner, its sinks, resume keys and shards. No torch at
import."""
