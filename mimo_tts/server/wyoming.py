"""`mimo-tts wyoming`: a Wyoming TTS server (Home Assistant's voice protocol) on the speech worker,
each text a `server/session.py` session, so it has the engine, limits and batching of
`mimo-tts serve`.

Events (the `wyoming` package, the optional `wyoming` extra): `describe` -> `info` (the model,
its voices, languages); `synthesize` -> `audio-start`, `audio-chunk`s (24 kHz s16le mono, each
as Stage-1 decodes it), `audio-stop`; the streaming form `synthesize-start`, `-chunk`s, `-stop`
is spoken sentence by sentence as the text comes (`synthesis.text.sentences`, the rule that
splits long text; one audio-start/stop per sentence), then
`synthesize-stopped`. A failure is an `error` event and the connection stays. Each connection
speaks its texts in order in its own task, so a client that disconnects is seen at once: its
jobs are cancelled and its place in the queue freed. TCP, loopback by default; no key (Wyoming
has none): bind another address only on a trusted network.
"""

from __future__ import annotations

import asyncio
import signal
import traceback
from dataclasses import replace

from mimo_tts._version import __version__
from mimo_tts.errors import MimoTTSError, UsageError
from mimo_tts.server.lifecycle import SHUTDOWN_GRACE_S, STOP_SIGNALS, loaded, url_of
from mimo_tts.server.protocol import (
    ApiError,
    RequestParser,
    ServeConfig,
    public_model_name,
)
from mimo_tts.server.session import Sessions
from mimo_tts.server.voices import client_message
from mimo_tts.synthesis.audio import SAMPLE_RATE, pcm16
from mimo_tts.synthesis.markup import script
from mimo_tts.synthesis.settings import OptionValues
from mimo_tts.synthesis.text import clean_text, ended_sentences
from mimo_tts.synthesis.voices import BUILT_IN, served_voices

EXTRA_HINT = "mimo-tts wyoming needs the wyoming extra: pip install 'mimo-tts[wyoming]'"
LANGUAGES = ["en", "zh"]  # what MiMo-Audio was trained to speak
SOURCE = "https://github.com/XiaomiMiMo/MiMo-Audio"
WIDTH, CHANNELS = 2, 1  # s16le mono


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
        usual pause), audio-stop, through `send(event)`. Busy, bad or failing: an ApiError."""
        from wyoming.audio import AudioChunk, AudioStart, AudioStop

        text, options = self.options(text, voice)
        session = self.sessions.open("wyoming")
        if session is None:
            raise ApiError(503, "the server is busy (queue full); retry later", code="busy")
        loop, outcome = asyncio.get_running_loop(), "cancelled"
        try:
            async with asyncio.timeout(self.cfg.timeout):
                prompts = await loop.run_in_executor(None, self.tts.prompts, text, options,
                                                     options.seed)
                session.start(prompts, options, streamed=True)
                fmt = {"rate": SAMPLE_RATE, "width": WIDTH, "channels": CHANNELS}
                await send(AudioStart(**fmt).event())
                pauses = script(text, options).pauses
                for i in range(len(prompts)):
                    if pauses[i]:
                        await send(AudioChunk(audio=bytes(WIDTH * pauses[i]), **fmt).event())
                    while (event := await session.next_event(i))[0] == "audio":
                        await send(AudioChunk(audio=pcm16(event[1]), **fmt).event())
                    if event[0] == "error":
                        outcome = "failed"
                        raise ApiError.of(event[1], client_message(str(event[1]), self))
                if pauses[-1]:
                    await send(AudioChunk(audio=bytes(WIDTH * pauses[-1]), **fmt).event())
                await send(AudioStop().event())
                outcome = "ok"
        except TimeoutError:
            outcome = "failed"
            raise ApiError(504, f"the request took longer than this server's timeout "
                           f"({self.cfg.timeout:g} s)", code="timeout") from None
        except MimoTTSError as exc:  # a voice that cannot be read, say
            outcome = "failed"
            raise ApiError.of(exc, client_message(str(exc), self)) from None
        finally:
            session.release(outcome)
            if outcome == "cancelled":
                self.log(f"{session.label}: cancelled (the client went away)")

    def close(self) -> None:
        self.sessions.close(timeout=SHUTDOWN_GRACE_S)


class Connection:
    """One client: events are read as they come while its texts are spoken in order by one
    task, so an EOF (the client went away) cancels what it asked for at once."""

    def __init__(self, speech: WyomingSpeech, reader, writer):
        self.speech, self.reader, self.writer = speech, reader, writer
        self.texts: asyncio.Queue = asyncio.Queue()
        self.stream: dict | None = None  # the streaming form's voice and unspoken text

    async def run(self) -> None:
        """Read until EOF (the client closed): then what it still waits for is cancelled."""
        from wyoming.event import async_read_event

        speaker = asyncio.create_task(self.speak_all())
        try:
            while (event := await async_read_event(self.reader)) is not None:
                await self.handle(event)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
            self.writer.close()

    async def send(self, event) -> None:
        from wyoming.event import async_write_event

        await async_write_event(event, self.writer)

    async def handle(self, event) -> None:
        from wyoming.info import Describe
        from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

        if Describe.is_type(event.type):
            await self.texts.put(("info", None, None))
        elif Synthesize.is_type(event.type):
            if self.stream is None:  # while streaming it repeats the text for old servers
                said = Synthesize.from_event(event)
                await self.texts.put(("say", said.text, _voice_name(said.voice)))
        elif SynthesizeStart.is_type(event.type):
            started = SynthesizeStart.from_event(event)
            self.stream = {"voice": _voice_name(started.voice), "text": ""}
        elif SynthesizeChunk.is_type(event.type) and self.stream is not None:
            self.stream["text"] += SynthesizeChunk.from_event(event).text
            done, self.stream["text"] = ended_sentences(self.stream["text"])
            for sentence in done:
                await self.texts.put(("say", sentence, self.stream["voice"]))
        elif SynthesizeStop.is_type(event.type) and self.stream is not None:
            rest, voice, self.stream = self.stream["text"], self.stream["voice"], None
            if rest.strip():
                await self.texts.put(("say", rest, voice))
            await self.texts.put(("stopped", None, None))

    async def speak_all(self) -> None:
        """Answer the queued asks in order; an ApiError becomes an `error` event."""
        from wyoming.error import Error
        from wyoming.tts import SynthesizeStopped

        while True:
            kind, text, voice = await self.texts.get()
            try:
                if kind == "info":
                    await self.send(self.speech.info().event())
                elif kind == "stopped":
                    await self.send(SynthesizeStopped().event())
                else:
                    await self.speech.speak(text, voice, self.send)
            except ApiError as exc:
                code = exc.code or ("bad-request" if exc.status < 500 else "synthesis-failed")
                await self.send(Error(text=exc.message, code=code).event())
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as exc:  # a bug: this text fails, the connection goes on
                self.speech.log(traceback.format_exc())
                message = client_message(str(exc), self.speech)
                await self.send(Error(text=f"unexpected {type(exc).__name__}: {message}",
                                      code="synthesis-failed").event())


def _voice_name(voice) -> str | None:
    return getattr(voice, "name", None)


async def serve_wyoming(speech: WyomingSpeech, sock) -> str:
    """Serve connections on the bound `sock` until a stop signal; that signal's name."""
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

    server = await asyncio.start_server(accept, sock=sock)
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
        reporter.info(f"serving {speech.model} over Wyoming on {url_of(host, port, 'tcp')} (batch "
                      f"{cfg.batch_size}; voices {', '.join(speech.voices())}; no API key)")
        try:
            stopped_by = asyncio.run(serve_wyoming(speech, sock))
        finally:
            speech.close()
    reporter.info(f"server stopped ({stopped_by})")
    return 0
