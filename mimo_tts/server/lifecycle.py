"""How `mimo-tts serve` starts and stops around the app of `server/app.py`.

The address is bound before the model loads, so a taken port or a bad host is one line and exit
5 in seconds; uvicorn then listens on that socket (`--port 0`: the port the kernel chose).
SIGINT, SIGTERM and SIGHUP all stop it the same way: no new connections, the requests in flight
get `SHUTDOWN_GRACE_S` to finish, then uvicorn cancels them (the app cancels their engine jobs)
and the caller prints one line. uvicorn's own messages about that stop, which the server reports
itself, are kept out of the log; everything else it logs stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import replace

from mimo_tts.errors import OutputError
from mimo_tts.server.protocol import ServeConfig, encode_voices, read_voices
from mimo_tts.synthesis.settings import OptionValues, resolve

SHUTDOWN_GRACE_S = 5  # uvicorn's timeout_graceful_shutdown: what requests in flight get on a stop
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# uvicorn's error-log lines for a stop or an abort the server reports in its own words
REPLACED_MESSAGES = ("ASGI callable returned without completing response",
                     "Cancel %s running task(s), timeout graceful shutdown exceeded")


def bind(host: str, port: int, scheme: str = "http") -> socket.socket:
    """A socket bound to (host, port), not yet listening (connections are refused until the
    server is up); a taken port or an unknown host is an OutputError (exit 5)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds it
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OutputError(f"cannot serve on {url_of(host, port, scheme)}: "
                          f"{exc.strerror or exc}") from None
    return sock


def url_of(host: str, port: int, scheme: str = "http") -> str:
    """The address as its face's clients write it: `http://` for serve, `tcp://` for Wyoming."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def serve(app, sock: socket.socket, verbose: bool) -> str:
    """Serve the ASGI `app` on the bound `sock` until a stop signal; that signal's name."""
    import uvicorn

    config = uvicorn.Config(app, access_log=False, lifespan="off",  # the app's request log
                            log_level="info" if verbose else "warning",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = uvicorn.Server(config)  # its Config set the loggers up: the filter goes after
    logging.getLogger("uvicorn.error").addFilter(_replaced)
    with _stop_signals(server) as caught:
        server.run(sockets=[sock])
    return signal.Signals(caught[0]).name if caught else "exit"


@contextlib.contextmanager
def _stop_signals(server):
    """SIGINT, SIGTERM and SIGHUP ask `server` to stop (uvicorn takes only the first two, and
    raises them again once it has stopped: here that second delivery just notes the signal)."""
    caught: list[int] = []

    def stop(signum, frame) -> None:
        caught.append(signum)
        server.handle_exit(signum, frame)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _replaced(record: logging.LogRecord) -> bool:
    """Keep a uvicorn record unless it tells of a stop the server reports itself: an aborted
    stream, the grace period's end, a request task cancelled by it."""
    if isinstance(record.msg, str) and record.msg.startswith(REPLACED_MESSAGES):
        return False
    cancelled = record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError)
    return not cancelled


@contextlib.contextmanager
def loaded(cfg: ServeConfig, options: OptionValues, config: str | None, reporter,
           scheme: str = "http"):
    """What both servers do before they answer: resolve the model's options (Stage-0 and
    Stage-1 side by side, as with --stream, so the thread budgets split the CPU), check the
    start-up voices, bind (a taken port fails before anything loads), load once through the one
    loader and encode the voices -> (settings, the bound socket, the loaded MiMoTTS)."""
    from mimo_tts.synthesis.preflight import lengths_for
    from mimo_tts.synthesis.profiles import load_profile
    from mimo_tts.synthesis.synthesizer import MiMoTTS
    from mimo_tts.synthesis.voices import VoiceStore, check_startup_voices

    settings = resolve(replace(options, stream=True), load_profile(config), os.environ)
    check_startup_voices(cfg.voices, VoiceStore())  # no clash with a stored voice
    read_voices(cfg.voices)  # before anything loads
    sock = bind(cfg.host, cfg.port, scheme)
    # requests' audio may decode together: a batch of rows; uploads encode voices
    lengths = lengths_for(settings, [], cfg.batch_size, decode_rows=cfg.batch_size)
    with sock, MiMoTTS.from_settings(settings, lengths, reporter.log) as tts:
        packing_s = tts.stage1.pack_decoder()  # a server decodes a lot: now, not mid-stream
        if packing_s is not None:
            reporter.log(f"tokenizer decoder packed for serving in {packing_s:.2f} s")
        tts.startup_voices = dict(cfg.voices)  # a `[voice:]` tag may name them too
        encode_voices(tts, cfg.voices, settings.synthesis)
        yield settings, sock, tts
