"""`mimo-tts wyoming` against a real server process, with the `wyoming` package's own client:
describe -> info, synthesize -> audio-start/chunks/stop, the streaming form sentence by
sentence, errors as `error` events, and a client that disconnects frees its place."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("wyoming")

from wyoming.audio import AudioChunk, AudioStart  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.error import Error  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.tts import (  # noqa: E402
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

READ_S = 120  # one event, on a busy 2-core machine


@pytest.fixture(scope="module")
def server(start_wyoming):
    return start_wyoming("--max-concurrent", 1, "--max-queue", 1)


def exchange(address: str, events: list, until: tuple[str, ...]) -> list:
    """Connect, send `events`, read until an event type in `until`: the events read."""
    host, port = address.split(":")

    async def run():
        async with AsyncTcpClient(host, int(port)) as client:
            for event in events:
                await client.write_event(event.event())
            read = []
            while True:
                event = await asyncio.wait_for(client.read_event(), READ_S)
                assert event is not None, f"closed after {[e.type for e in read]}"
                read.append(event)
                if event.type in until:
                    return read

    return asyncio.run(run())


def audio_cycles(events: list) -> list[bytes]:
    """The PCM of each audio-start .. audio-stop cycle, checking the format on the way."""
    cycles, current = [], None
    for event in events:
        if AudioStart.is_type(event.type):
            start = AudioStart.from_event(event)
            assert (start.rate, start.width, start.channels) == (24000, 2, 1)
            current = []
        elif AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            assert (chunk.rate, chunk.width, chunk.channels) == (24000, 2, 1)
            current.append(chunk.audio)
        elif event.type == "audio-stop":
            cycles.append(b"".join(current))
    return cycles


def test_describe_answers_info_with_the_model_voices_and_languages(server):
    (event,) = exchange(server, [Describe()], ("info",))
    (program,) = Info.from_event(event).tts
    assert program.name == "mimo-tts" and program.supports_synthesize_streaming
    assert "tiny" in program.description and program.installed
    assert [v.name for v in program.voices] == ["default", "natural"]
    assert all(v.languages == ["en", "zh"] for v in program.voices)


def test_synthesize_streams_chunks_of_whole_frames(server):
    events = exchange(server, [Synthesize(text="Hello over Wyoming.")], ("audio-stop", "error"))
    assert [e.type for e in events][0] == "audio-start", events[-1].data
    (pcm,) = audio_cycles(events)
    chunks = [e for e in events if AudioChunk.is_type(e.type)]
    assert len(chunks) >= 1 and len(pcm) > 0 and len(pcm) % (2 * 960) == 0
    assert all(len(AudioChunk.from_event(c).audio) % 2 == 0 for c in chunks)


def test_speed_at_start_up_stretches_each_text(server, start_wyoming):
    """`mimo-tts wyoming --speed 2` (Wyoming's requests carry no rate): half the samples of
    the same text at speed 1, in whole frames' worth of PCM16."""
    fast = start_wyoming("--speed", 2)
    said = [Synthesize(text="Hello over Wyoming.")]
    (plain,) = audio_cycles(exchange(server, said, ("audio-stop", "error")))
    (quick,) = audio_cycles(exchange(fast, said, ("audio-stop", "error")))
    assert len(quick) // 2 == round(len(plain) // 2 / 2)
    fast.stop()


def test_a_pause_tag_is_its_samples_of_silence(server):
    """[pause:0.5] before the words and [pause:1] after them: the text's PCM is the plain
    text's with exactly 12000 zero samples before and 24000 after."""
    said = [Synthesize(text="One here.")]
    (plain,) = audio_cycles(exchange(server, said, ("audio-stop", "error")))
    paused = [Synthesize(text="[pause:0.5] One here. [pause:1]")]
    (longer,) = audio_cycles(exchange(server, paused, ("audio-stop", "error")))
    assert longer == bytes(2 * 12000) + plain + bytes(2 * 24000)


def test_voice_tags_speak_each_span_in_its_voice(server):
    """`[voice:natural] ... [voice:default] ...` in one text: one audio cycle, longer than
    either span said alone (both spans and the pause between them); an unknown voice in a
    tag (bracket or SSML) is an error event naming it, and the connection goes on."""
    spans = ("Speak softly now.", "One here.")
    alone = [audio_cycles(exchange(server, [Synthesize(text=t)], ("audio-stop", "error")))[0]
             for t in spans]
    text = f"[voice:natural] {spans[0]} [voice:default] {spans[1]}"
    (both,) = audio_cycles(exchange(server, [Synthesize(text=text)], ("audio-stop", "error")))
    assert len(both) > max(len(a) for a in alone)
    assert both.endswith(alone[1])  # the default span: the plain text's audio
    events = exchange(server, [Synthesize(text="[voice:nobody] Hi."),
                               Synthesize(text='<speak><voice name="nobody">Hi.</voice></speak>'),
                               Describe()], ("info",))
    errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
    assert len(errors) == 2 and all("unknown voice 'nobody'" in e.text for e in errors)
    assert Info.is_type(events[-1].type)


def test_the_streaming_form_speaks_sentence_by_sentence(server):
    texts = ["The first sen", "tence ends here. The sec", "ond one too! And a tail"]
    events = [SynthesizeStart(voice=SynthesizeVoice(name="default")),
              *[SynthesizeChunk(text=t) for t in texts],
              Synthesize(text="".join(texts)),  # repeated for servers without streaming
              SynthesizeStop()]
    read = exchange(server, events, ("synthesize-stopped", "error"))
    assert read[-1].type == "synthesize-stopped", read[-1].data
    assert len(audio_cycles(read)) == 3  # three sentences, the repeat ignored


def test_an_unknown_voice_or_empty_text_is_an_error_event_and_the_connection_stays(server):
    events = exchange(server, [Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")),
                               Synthesize(text="   "), Describe()], ("info",))
    errors = [Error.from_event(e) for e in events if Error.is_type(e.type)]
    assert "unknown voice 'nobody'" in errors[0].text and "default, natural" in errors[0].text
    assert len(errors) == 2 and "empty" in errors[1].text


def test_a_client_that_disconnects_frees_its_place(server):
    host, port = server.split(":")

    async def leave_early():
        async with AsyncTcpClient(host, int(port)) as client:
            await client.write_event(Synthesize(text="Gone before the end. " * 3).event())
            event = await asyncio.wait_for(client.read_event(), READ_S)
            assert event.type == "audio-start"

    asyncio.run(leave_early())
    deadline = time.monotonic() + 30
    while "cancelled (the client went away)" not in server.stderr():
        assert time.monotonic() < deadline, server.stderr()
        time.sleep(0.2)
    # --max-concurrent 1: the next client gets the one place
    events = exchange(server, [Synthesize(text="My turn.")], ("audio-stop", "error"))
    assert events[-1].type == "audio-stop", events[-1].data


def test_info_lists_the_voices_of_the_serving_line_registry_included(start_wyoming, mimo,
                                                                     tmp_path):
    """Issue 32 item 8: one list of served voices (`served_voices`) on every face."""
    import numpy as np
    import soundfile as sf

    sf.write(str(tmp_path / "me.wav"), np.full(16000, 0.1, dtype="float32"), 16000)
    env = {"MIMO_TTS_VOICES_DIR": str(tmp_path / "store")}
    assert mimo("voices", "add", "stored", "me.wav", "--model", "tiny", env=env).returncode == 0
    served = start_wyoming("--voice", f"startup={tmp_path / 'me.wav'}", env=env)
    (event,) = exchange(served, [Describe()], ("info",))
    (program,) = Info.from_event(event).tts
    names = [v.name for v in program.voices]
    assert names == ["default", "natural", "startup", "stored"]
    line = next(x for x in served.stderr().splitlines() if x.startswith("serving "))
    assert f"voices {', '.join(names)};" in line


def test_uri_as_wyoming_piper_takes_it(start_wyoming):
    """Issue 32 item 14: `--uri tcp://HOST:PORT`, copied from wyoming-piper, is accepted."""
    served = start_wyoming("--uri", "tcp://127.0.0.1:0")
    (event,) = exchange(served, [Describe()], ("info",))
    assert Info.from_event(event).tts[0].name == "mimo-tts"
