"""`mimo-tts wyoming` against hostile and odd clients on raw sockets (issue 32 items 17 and 19):
declared lengths past the server's bounds, headers that are not events, fields of the wrong
type, an endless `synthesize-chunk` stream, a half-closed client and one that stops reading.
Each gets an `error` event (never a traceback, never "unexpected"), memory stays bounded, and
the server goes on serving: one place in progress (`--max-concurrent 1`), so a client still
holding it would stall the next."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

pytest.importorskip("wyoming")

from wyoming.event import read_event  # noqa: E402

from tests.wyoming.test_wyoming_server import exchange  # noqa: E402

READ_S = 120  # one event, on a busy 2-core machine
DEADLINE_S = 20  # --timeout
LIMIT_CHARS = 20000  # --max-input-chars
FILL_S = 8  # a stalled client's buffers fill well before this (as in the HTTP test)
# 40 text pieces: about 6 MB of PCM, twice what the socket buffers take
LONG = " ".join(f"Sentence {i} is long enough to fill most of a piece of its own, "
                f"{'and it goes on ' * 14}until it ends." for i in range(40))


@pytest.fixture(scope="module")
def server(start_wyoming):
    return start_wyoming("--max-concurrent", 1, "--max-queue", 1, "--max-input-chars",
                         LIMIT_CHARS, "--timeout", DEADLINE_S)


def connect(address: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = address.split(":")
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(READ_S)
    sock.connect((host, int(port)))
    return sock


def header(kind: str, **fields) -> bytes:
    return json.dumps({"type": kind, **fields}).encode() + b"\n"


def event(kind: str, **data) -> bytes:
    body = json.dumps(data).encode()
    return header(kind, data_length=len(body)) + body


def read_until(sock: socket.socket, until: tuple[str, ...]) -> list:
    """The events read until one of `until` types, or the end of the connection."""
    stream, read = sock.makefile("rb"), []
    while (got := read_event(stream)) is not None:
        read.append(got)
        if got.type in until:
            break
    return read


def errors(events: list) -> list[str]:
    return [e.data["text"] for e in events if e.type == "error"]


def served_after(server) -> None:
    """The server answers the next client, and has logged no traceback."""
    from wyoming.info import Describe

    events = exchange(server, [Describe()], ("info",))
    assert events[-1].type == "info"
    assert "Traceback" not in server.stderr() and "unexpected" not in server.stderr()


@pytest.mark.parametrize(("sent", "words"), [
    (header("synthesize", data_length=1 << 40), "data_length 1099511627776 is over"),
    (header("synthesize", payload_length=1 << 30), "payload_length 1073741824 is over"),
    (header("synthesize", data_length=-1), "data_length -1 is not a length"),
    (b"{" + b" " * (1 << 20), "event header longer than"),
    (b"not json\n", "an event header that is not JSON"),
    (b"[1, 2]\n", "an event header that is not a JSON object with a type"),
    (b'{"data": {}}\n', "an event header that is not a JSON object with a type"),
])
def test_bad_framing_is_an_error_event_then_the_connection_closes(server, sent, words):
    """Before: a declared length was read whatever it was (memory grew with what the client
    sent), and a header the package could not parse closed the connection without a word or
    raised a traceback."""
    with connect(server) as sock:
        sock.sendall(sent)
        events = read_until(sock, ())  # until the server closes the connection
    assert [e.type for e in events] == ["error"], events
    assert words in errors(events)[0]
    served_after(server)


def test_fields_of_the_wrong_type_are_error_events_and_the_connection_stays(server):
    """Before: `"text": 5` was an "unexpected TypeError", `"voice": "x"` a traceback."""
    with connect(server) as sock:
        sock.sendall(event("synthesize", text=5) + event("synthesize", text="Hi.", voice="x")
                     + event("synthesize-start", voice=[]) + event("synthesize-chunk")
                     + header("synthesize", data_length=3) + b"[1]"
                     + event("describe"))
        events = read_until(sock, ("info",))
    assert errors(events) == [
        "synthesize: text must be a string", "synthesize: voice must be an object",
        "synthesize-start: voice must be an object", "synthesize-chunk: text must be a string",
        "an event whose data is not a JSON object"]
    assert events[-1].type == "info"
    served_after(server)


def test_an_endless_chunk_stream_is_refused_at_the_limit(server):
    """Before: the unspoken text grew with every chunk (and each chunk rescanned it all), and
    nothing was said until `synthesize-stop`."""
    chunk = "word " * 200  # 1000 characters, no sentence end
    with connect(server) as sock:
        sock.sendall(event("synthesize-start"))
        for _ in range(LIMIT_CHARS // len(chunk) + 1):
            sock.sendall(event("synthesize-chunk", text=chunk))
        refused = read_until(sock, ("error",))  # before the stop is sent
        assert f"no sentence end in {LIMIT_CHARS} characters" in errors(refused)[0]
        sock.sendall(event("synthesize-chunk", text=chunk + "ignored.")
                     + event("synthesize-stop"))
        stopped = read_until(sock, ("synthesize-stopped",))
    assert [e.type for e in stopped] == ["synthesize-stopped"]  # no audio for the rest
    served_after(server)


def test_a_half_closed_client_still_gets_its_audio(server):
    """Before: the end of its writes read as a client gone, and its text was cancelled."""
    with connect(server) as sock:
        sock.sendall(event("synthesize", text="Half closed, still heard."))
        sock.shutdown(socket.SHUT_WR)
        events = read_until(sock, ())
    assert [e.type for e in events][0] == "audio-start", events
    assert events[-1].type == "audio-stop"
    assert sum(len(e.payload or b"") for e in events) > 0


def test_a_client_that_stops_reading_is_closed_at_the_deadline(server):
    """Before: the send after the deadline (its `error` event) waited for good, so the
    connection was held open; now it is closed at `--timeout` and the next client, waiting
    for the one place, is served."""
    with connect(server, receive_buffer=4096) as stalled:
        stalled.sendall(event("synthesize", text=LONG))
        time.sleep(FILL_S)
        events = exchange(server, [_synthesize("My turn.")], ("audio-stop", "error"))
        assert events[-1].type == "audio-stop", events[-1].data
        stalled.settimeout(READ_S)
        while stalled.recv(1 << 16):  # what it was sent, then the end: closed by the server
            pass
    assert re.search(r"wyoming-\d+: the client stopped reading; closed at --timeout \(20 s\)",
                     server.stderr())
    served_after(server)


def _synthesize(text: str):
    from wyoming.tts import Synthesize

    return Synthesize(text=text)
