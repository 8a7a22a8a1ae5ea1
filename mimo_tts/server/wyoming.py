"""`mimo-tts wyoming`: a Wyoming TTS server (Home Assistant's voice protocol) on the speech worker,
each text a `server/session.py` session, so it has the engine, limits and batching of
`mimo-tts serve`.

Events (the `wyoming` package, the optional `wyoming` extra): `describe` -> `info` (the model,
its voices, languages); `synthesize` -> `audio-start`, `audio-chunk`s (24 kHz s16le mono, each
as Stage-1 decodes it), `audio-stop`; the streaming form `synthesize-start`, `-chunk`s, `-stop`
is spoken sentence by sentence as the text comes (`synthesis.text.sentences`, the rule that
splits long text; one audio-start/stop per sentence), then `synthesize-stopped`. A failure is
an `error` event and the connection stays. Each connection reads its events (bounded,
`wyoming_wire.py`) while one task speaks its texts in order: a client that disconnects is seen
at the next send, its jobs cancelled and its place freed; one that only closes its side gets
its audio first; one that stops reading is closed at its text's `--timeout`. TCP, loopback by
default; no key (Wyoming has none): bind another address only on a trusted network.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import traceback
from dataclasses import replace

from mimo_tts._version import __version__
from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.server.lifecycle import SHUTDOWN_GRACE_S, STOP_SIGNALS, loaded, url_of
from mimo_tts.server.protocol import ApiError, RequestParser, ServeConfig, public_model_name
from mimo_tts.server.session import Sessions
from mimo_tts.server.voices import client_message
from mimo_tts.server.wyoming_wire import (
    BadEvent,
    WireEvent,
    event_bytes,
    read_event,
    text_field,
    voice_field,
)
from mimo_tts.synthesis.audio import SAMPLE_RATE, pcm16
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.settings import OptionValues
from mimo_tts.synthesis.text import clean_text, ended_sentences
from mimo_tts.synthesis.voices import BUILT_IN, served_voices

EXTRA_HINT = "mimo-tts wyoming needs the wyoming extra: pip install 'mimo-tts[wyoming]'"
LANGUAGES = ["en", "zh"]  # what MiMo-Audio was trained to speak
SOURCE = "https://github.com/XiaomiMiMo/MiMo-Audio"
WIDTH, CHANNELS = 2, 1  # s16le mono
MAX_QUEUED = 16  # a connection's asks not yet answered; past it, its events wait to be read
LINGER_S, LINGER_READS = 2.0, 64  # what a closing connection still reads and drops: 4 MiB


class WyomingSpeech:
    """The Wyoming face over one loaded `MiMoTTS`: its own `Sessions` (worker and places),
    built as `mimo-tts serve` builds them, and the voices as `RequestParser` maps them."""

    def __init__(self, tts, cfg, base, model: str, log=None):
        self.tts, self.cfg, self.base, self.model = tts, cfg, base, model
        self.log = log or (lambda message: None)
        self.parser = RequestParser(cfg, base, model, (), tts.voices)
        self.sessions = Sessions(tts, cfg, base, self.log)

    def voices(self) -> list[str]:
        """The default, the natural-instruction style, the start-up voices and the registry's."""
        return [name for name, _ in served_voices(self.cfg.voices, self.tts.voices)]

    def info(self):
        """The `info` event's body: one TTS program (the model) and its voices."""
        from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

        by = Attribution(name="Xiaomi MiMo", url=SOURCE)
        voices = [TtsVoice(name=name, attribution=by, installed=True, version=None,
                           description=BUILT_IN[name][1] if name in BUILT_IN else "voice clone",
                           languages=list(LANGUAGES)) for name in self.voices()]
        program = TtsProgram(name="mimo-tts", attribution=by, installed=True,
                             description=f"MiMo-Audio text to speech ({self.model})",
                             version=__version__, voices=voices,
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    def options(self, text: str, voice: str | None):
        """The synthesis options of one text and voice name; refusals are `ApiError`s."""
        try:
            text = clean_text(self.parser.bounded(text, "text"), "text")
        except MimoTTSError as exc:  # empty, control characters
            raise ApiError.of(exc) from None
        task, prompt_audio, stored = self.parser.voice(voice or "default", None)
        options = replace(self.base, task=task, instruct=None, prompt_audio=prompt_audio,
                          voice=stored)
        self.parser.tags(text, options, "text", "describe lists them")  # before a place
        return text, options

    async def speak(self, text: str, voice: str | None, send) -> None:
        """One text: audio-start, audio-chunks as Stage-1 decodes them (its pieces apart by the
        usual pause), audio-stop, through `send(event, deadline)`. Busy, bad, failing or past
        `--timeout`: an ApiError; a client that stops reading: `ClientStalled` from `send`."""
        from wyoming.audio import AudioChunk, AudioStart, AudioStop

        text, options = self.options(text, voice)
        session = self.sessions.open("wyoming")
        if session is None:
            raise ApiError(503, "the server is busy (queue full); retry later", code="busy")
        loop, outcome, deadline = asyncio.get_running_loop(), "cancelled", session.deadline
        try:
            prompts = await asyncio.wait_for(loop.run_in_executor(
                None, self.tts.prompts, text, options, options.seed), deadline - loop.time())
            session.start(prompts, options, streamed=True)
            fmt = {"rate": SAMPLE_RATE, "width": WIDTH, "channels": CHANNELS}
            await send(AudioStart(**fmt).event(), deadline)
            pauses = script(text, options).pauses  # samples before each piece and after the last
            for i in range(len(prompts)):
                if pauses[i]:
                    await send(AudioChunk(audio=bytes(WIDTH * pauses[i]), **fmt).event(),
                               deadline)
                while (event := await session.next_event(i))[0] == "audio":
                    await send(AudioChunk(audio=pcm16(event[1]), **fmt).event(), deadline)
                if event[0] == "error":
                    outcome = "failed"
                    raise ApiError.of(event[1], client_message(str(event[1]), self))
            if pauses[-1]:
                await send(AudioChunk(audio=bytes(WIDTH * pauses[-1]), **fmt).event(), deadline)
            await send(AudioStop().event(), deadline)
            outcome = "ok"
        except TimeoutError:  # the generation's (a stalled send is ClientStalled)
            outcome = "failed"
            raise ApiError(504, f"the request took longer than this server's timeout "
                           f"({self.cfg.timeout:g} s)", code="timeout") from None
        except ClientStalled:
            outcome = "timeout"
            self.log(f"{session.label}: the client stopped reading; closed at --timeout "
                     f"({self.cfg.timeout:g} s)")
            raise
        except MimoTTSError as exc:  # a voice that cannot be read, say
            outcome = "failed"
            raise ApiError.of(exc, client_message(str(exc), self)) from None
        finally:
            session.release(outcome)
            if outcome == "cancelled":
                self.log(f"{session.label}: cancelled (the client went away)")

    def close(self) -> None:
        self.sessions.close(timeout=SHUTDOWN_GRACE_S)


class ClientStalled(Exception):
    """A send to a client that stopped reading did not finish by its deadline."""


class Connection:
    """One client, as the module docstring says. What is queued is bounded (`MAX_QUEUED`
    asks; reading waits), as is each event (`wyoming_wire`) and the unspoken text of a stream
    (`--max-input-chars`)."""

    def __init__(self, speech: WyomingSpeech, reader, writer):
        self.speech, self.reader, self.writer = speech, reader, writer
        self.texts: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self.stream: dict | None = None  # the streaming form's voice and unspoken text
        self.limit = event_bytes(speech.cfg.max_input_chars)

    async def run(self) -> None:
        """Read until the client's side ends (or a fatal `BadEvent`), speak what it asked
        for, close; the speaker's end (a client gone or stalled) ends the reading too."""
        speaker = asyncio.create_task(self.speak_all())
        reading = asyncio.create_task(self.read_all())
        try:
            await asyncio.wait({speaker, reading}, return_when=asyncio.FIRST_COMPLETED)
            if reading.done() and reading.exception() is None:
                await speaker  # a half-closed client still gets its audio
                await self.linger()
        except (ConnectionError, ClientStalled):
            pass
        finally:
            for task in (reading, speaker):
                task.cancel()
            await asyncio.gather(reading, speaker, return_exceptions=True)
            if speaker_stalled(speaker):
                self.writer.transport.abort()
            else:
                self.writer.close()

    async def linger(self) -> None:
        """Before the close: the end of what the server sends, then what the client still
        sends is read and dropped (bounded), so that the close does not reset the connection
        before the client reads the last events (an `error` event for a stream cut short)."""
        if self.writer.can_write_eof():
            self.writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(LINGER_S):
                for _ in range(LINGER_READS):
                    if not await self.reader.read(1 << 16):
                        return

    async def read_all(self) -> None:
        """Each event handled in order; a refusal queued as an `error` event; at the end
        (the client's, or a stream that can no longer be read) the speaker is told."""
        while True:
            try:
                event = await read_event(self.reader, self.limit)
                if event is None:
                    break
                await self.handle(event)
            except BadEvent as exc:
                await self.texts.put(("error", str(exc), None))
                if exc.fatal:  # the stream cannot be cut into events any more
                    break
            except (ConnectionError, asyncio.IncompleteReadError):
                break
        await self.texts.put(("end", None, None))

    async def send(self, event, deadline: float | None = None) -> None:
        """Write one event, by `deadline` (loop time; default: `--timeout` from now), else
        `ClientStalled`."""
        from wyoming.event import async_write_event

        loop = asyncio.get_running_loop()
        left = (loop.time() + self.speech.cfg.timeout if deadline is None else deadline) \
            - loop.time()
        try:
            async with asyncio.timeout(max(left, 0)):
                await async_write_event(event, self.writer)
        except TimeoutError:
            raise ClientStalled from None

    async def handle(self, event: WireEvent) -> None:
        from wyoming.info import Describe
        from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

        if Describe.is_type(event.type):
            await self.texts.put(("info", None, None))
        elif Synthesize.is_type(event.type):
            text, voice = text_field(event), voice_field(event)
            if self.stream is None:  # while streaming it repeats the text for old servers
                await self.texts.put(("say", text, voice))
        elif SynthesizeStart.is_type(event.type):
            self.stream = {"voice": voice_field(event), "text": "", "refused": False}
        elif SynthesizeChunk.is_type(event.type):
            await self.stream_chunk(text_field(event))
        elif SynthesizeStop.is_type(event.type) and self.stream is not None:
            rest, voice, self.stream = self.stream["text"], self.stream["voice"], None
            if rest.strip():
                await self.texts.put(("say", rest, voice))
            await self.texts.put(("stopped", None, None))

    async def stream_chunk(self, text: str) -> None:
        """A chunk of the streaming form: each sentence it ends is spoken; unspoken text past
        `--max-input-chars` refuses the rest of the stream (until its stop)."""
        stream = self.stream
        if stream is None or stream["refused"]:
            return
        done, stream["text"] = ended_sentences(stream["text"] + text)
        for sentence in done:
            await self.texts.put(("say", sentence, stream["voice"]))
        limit = self.speech.cfg.max_input_chars
        if len(stream["text"]) > limit:
            stream["text"], stream["refused"] = "", True
            raise BadEvent(f"synthesize-chunk: the streamed text has no sentence end in "
                           f"{limit} characters (this server's limit); the rest of this "
                           "stream is not spoken")

    async def speak_all(self) -> None:
        """Answer the queued asks in order, until the end; an ApiError becomes an `error`
        event, a client that stopped reading ends the connection (`ClientStalled`)."""
        from wyoming.error import Error
        from wyoming.tts import SynthesizeStopped

        while True:
            kind, text, voice = await self.texts.get()
            try:
                if kind == "end":
                    return
                if kind == "info":
                    await self.send(self.speech.info().event())
                elif kind == "stopped":
                    await self.send(SynthesizeStopped().event())
                elif kind == "error":
                    await self.send(Error(text=text, code="bad-request").event())
                else:
                    await self.speech.speak(text, voice, self.send)
            except ApiError as exc:
                code = exc.code or ("bad-request" if exc.status < 500 else "synthesis-failed")
                await self.send(Error(text=exc.message, code=code).event())
            except ClientStalled:
                if kind != "say":  # (speak says so itself, naming the text's session)
                    self.speech.log("a client stopped reading; closed at --timeout "
                                    f"({self.speech.cfg.timeout:g} s)")
                raise
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as exc:  # a bug: this text fails, the connection goes on
                self.speech.log(traceback.format_exc())
                message = client_message(str(exc), self.speech)
                await self.send(Error(text=f"unexpected {type(exc).__name__}: {message}",
                                      code="synthesis-failed").event())


def speaker_stalled(speaker: asyncio.Task) -> bool:
    """Whether the speaker ended on a client that stopped reading (its unsent bytes are then
    dropped: a close would wait to flush them)."""
    return speaker.done() and not speaker.cancelled() and \
        isinstance(speaker.exception(), ClientStalled)


async def serve_wyoming(speech: WyomingSpeech, sock, ready=lambda: None) -> str:
    """Serve connections on the bound `sock` until a stop signal; that signal's name.
    `ready()` once it listens (the serving line: a client that reads it may connect)."""
    stopped = asyncio.Event()
    caught: list[int] = []
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, lambda s=sig: (caught.append(s), stopped.set()))
    connections: set[asyncio.Task] = set()

    async def accept(reader, writer) -> None:
        task = asyncio.current_task()
        connections.add(task)
        try:
            await Connection(speech, reader, writer).run()
        except asyncio.CancelledError:  # the server stops: this connection ends quietly
            pass
        finally:
            connections.discard(task)

    # the reader's limit bounds an event's header line (`wyoming_wire`)
    server = await asyncio.start_server(accept, sock=sock,
                                        limit=event_bytes(speech.cfg.max_input_chars))
    ready()
    try:
        await stopped.wait()
    finally:
        server.close()
        for task in list(connections):
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return signal.Signals(caught[0]).name if caught else "exit"


def require_extra() -> None:
    """The wyoming extra's package imports, else a UsageError naming the extra."""
    try:
        import wyoming  # noqa: F401
    except ImportError:
        raise UsageError(EXTRA_HINT) from None


def main(cfg: ServeConfig, options: OptionValues, config: str | None, reporter) -> int:
    """`mimo-tts wyoming` (after `require_extra`): check the voices, bind, load once, serve
    until a signal."""
    with loaded(cfg, options, config, reporter, "tcp") as (settings, sock, tts):
        speech = WyomingSpeech(tts, cfg, settings.synthesis,
                               public_model_name(settings.checkpoints.lm[0]), reporter.info)
        host, port = sock.getsockname()[:2]
        line = (f"serving {speech.model} over Wyoming on {url_of(host, port, 'tcp')} (batch "
                f"{cfg.batch_size}; voices {', '.join(speech.voices())}; no API key)")
        try:
            stopped_by = asyncio.run(serve_wyoming(speech, sock, lambda: reporter.info(line)))
        finally:
            speech.close()
    reporter.info(f"server stopped ({stopped_by})")
    return 0
