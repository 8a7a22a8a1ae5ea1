"""Wyoming events off the wire, bounded: what `mimo-tts wyoming` reads from a client.

An event is a JSON header line (`type`, optional `data`, `data_length`, `payload_length`), then
`data_length` bytes of JSON merged into its data, then `payload_length` bytes of payload. The
`wyoming` package reads whatever lengths a client declares; here the header line, the data and
the payload are each at most `Limits.event_bytes` (the longest text a client may send, as JSON,
with room to spare), and the fields the server reads are checked for their types. A refusal is
a `BadEvent` with the words of an `error` event: `fatal` when the stream can no longer be cut
into events (the connection then ends), else the connection goes on. No `wyoming` import: the
face (`server/wyoming.py`) turns a `WireEvent` into the package's events.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

EVENT_SPARE_BYTES = 64 << 10  # a header's other fields, a voice, JSON's framing
JSON_BYTES_PER_CHAR = 6  # the longest JSON spelling of one character (`\\u0001`)


class BadEvent(Exception):
    """An event the server refuses, in the words of its `error` event."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


@dataclass(frozen=True)
class WireEvent:
    type: str
    data: dict
    payload: bytes | None = None


def event_bytes(max_input_chars: int) -> int:
    """The bound on a header line, its data and its payload: a text of `max_input_chars`
    characters, each spelled as long as JSON may, and room for the rest."""
    return EVENT_SPARE_BYTES + JSON_BYTES_PER_CHAR * max_input_chars


async def read_event(reader: asyncio.StreamReader, limit: int) -> WireEvent | None:
    """The next event, or None at the end of the stream (a client gone, or one that closed
    its side); the reader's own `limit` bounds the header line (`asyncio.start_server`)."""
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError: no newline within the limit
        raise BadEvent(f"an event header longer than {limit} bytes", fatal=True) from None
    if not line.endswith(b"\n"):
        return None  # the end, perhaps in the middle of a header
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        raise BadEvent("an event header that is not JSON", fatal=True) from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise BadEvent("an event header that is not a JSON object with a type", fatal=True)
    lengths = [_length(header, name, limit) for name in ("data_length", "payload_length")]
    try:
        raw = await reader.readexactly(lengths[0]) if lengths[0] else None
        payload = await reader.readexactly(lengths[1]) if lengths[1] else None
    except asyncio.IncompleteReadError:
        return None
    data = header.get("data", {})
    if raw is not None:  # the framing holds from here: a bad event, not a broken stream
        try:
            extra = json.loads(raw)
        except (ValueError, RecursionError):
            extra = None
        if not isinstance(extra, dict) or not isinstance(data, dict):
            raise BadEvent("an event whose data is not a JSON object")
        data = {**data, **extra}
    if not isinstance(data, dict):
        raise BadEvent("an event whose data is not a JSON object")
    return WireEvent(header["type"], data, payload)


def _length(header: dict, name: str, limit: int) -> int:
    value = header.get(name)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadEvent(f"{name} {_shown(value)} is not a length", fatal=True)
    if value > limit:
        raise BadEvent(f"{name} {value} is over this server's limit of {limit} bytes",
                       fatal=True)
    return value


def text_field(event: WireEvent) -> str:
    """The event's `text`: a string (refused otherwise)."""
    text = event.data.get("text")
    if not isinstance(text, str):
        raise BadEvent(f"{event.type}: text must be a string")
    return text


def voice_field(event: WireEvent) -> str | None:
    """The event's voice name (`voice.name`), None when it names none."""
    voice = event.data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise BadEvent(f"{event.type}: voice must be an object")
    name = voice.get("name")
    if name is not None and not isinstance(name, str):
        raise BadEvent(f"{event.type}: voice.name must be a string")
    return name


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
