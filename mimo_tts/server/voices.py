"""`/v1/audio/voices`: the voice registry over HTTP (list, upload, delete).

An upload is multipart form data: `name`, `file` (the recording), optionally `transcript` and
`overwrite`. The body is refused past `MAX_VOICE_BYTES` (413) and a recording longer than one
encoder segment (60 s, `CodecConfig.segment_seconds`: 400) before anything is encoded; it is
encoded once, as a `--prompt-audio` file would be, and kept in the same store as `mimo-tts
voices add`. A request already admitted built its prompt from the codes it found, so a voice
replaced or deleted meanwhile does not change it.

No server path reaches a client: a record is shown without the tokenizer's or the recording's
path (`client_record`), and every message names the store as "the voice store", an upload by
its file name, and any other path as "a server path" (`client_message`). A store that cannot
be read at all is a JSON 500 saying why, never a traceback.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from mimo_tts.errors import InputError, MimoTTSError, UsageError
from mimo_tts.server.protocol import MAX_VOICE_BYTES, ApiError, read_body
from mimo_tts.synthesis.audio import audio_seconds
from mimo_tts.synthesis.voices import check_name, served_voices


def list_voices(server) -> dict:
    """Every voice a request may name, as `served_voices` lists them for every face (built-in,
    start-up, registry); a registry voice comes with its details, or its `error` when it
    cannot be used."""
    try:
        records = {r["name"]: r for r in server.tts.voices.list()}
        served = served_voices(server.cfg.voices, server.tts.voices)
    except MimoTTSError as exc:
        raise ApiError(500, "the voice store cannot be read: "
                       + client_message(str(exc), server)) from None
    data = []
    for name, kind in served:
        entry = {"name": name, "kind": kind}
        record = records.get(name) if kind == "registry" else None  # None: added just now
        if record is not None and "error" in record:
            entry["error"] = client_message(record["error"], server)
        elif record is not None:
            entry.update(seconds=record["source"]["seconds"], created_at=record["created_at"],
                         transcript=record.get("transcript"))
        data.append(entry)
    return {"object": "list", "voices": [name for name, _ in served], "data": data}


async def add_voice(server, request) -> dict:
    """A multipart upload -> a stored voice (its record, as `client_record` shows it)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request

    body = await read_body(request, MAX_VOICE_BYTES)

    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=8)
    except Exception as exc:  # noqa: BLE001 (the multipart parser's errors have no one base)
        raise ApiError(400, "the upload is not multipart form data: "
                       + client_message(str(exc), server)) from None
    upload, name = form.get("file"), form.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "the upload needs a name field", "name")
    if name in server.cfg.voices:
        raise ApiError(409, f"voice {name!r} is one of this server's start-up voices; pick "
                       "another name", "name")
    if upload is None or isinstance(upload, str):
        raise ApiError(400, "the upload needs a file field holding the recording", "file")
    transcript = form.get("transcript")
    overwrite = str(form.get("overwrite", "")).lower() in ("1", "true", "yes")
    data = await upload.read()
    label = f"upload:{Path(upload.filename or 'voice').name}"
    try:
        record = await run_in_threadpool(_encode, server.tts, name, data, transcript, overwrite,
                                         label)
    except MimoTTSError as exc:
        error = ApiError.of(exc, client_message(str(exc), server, **_fields()))
        error.param = _param(str(exc))
        raise error from None
    return client_record(record)


def _encode(tts, name: str, data: bytes, transcript, overwrite: bool, label: str) -> dict:
    check_name(name)  # before any decoding
    with tempfile.TemporaryDirectory(prefix="mimo-voice-") as folder:
        path = Path(folder) / "upload"
        path.write_bytes(data)
        try:
            longest = tts.codec.config.segment_seconds  # one encoder segment: one voice
            seconds = audio_seconds(path, "the uploaded file", label, longest)
        except InputError as exc:
            raise InputError(str(exc).replace(str(path), label)) from None
        if seconds > longest:
            raise UsageError(f"the recording is {seconds:.1f} s; a voice takes at most "
                             f"{longest:g} s")
        try:
            return tts.add_voice(name, path, transcript if isinstance(transcript, str) else None,
                                 overwrite, label)
        except MimoTTSError as exc:
            raise type(exc)(str(exc).replace(str(path), label)
                            .replace(folder, "the upload")) from None


def delete_voice(server, name: str) -> dict:
    try:
        server.tts.voices.remove(name)
    except MimoTTSError as exc:
        error = ApiError.of(exc, client_message(str(exc), server, **_fields()))
        if "unknown voice" in str(exc):
            error.status = 404
        raise error from None
    return {"name": name, "deleted": True}


def client_record(record: dict) -> dict:
    """A stored voice's record as a client sees it: its name, source (an upload's label or
    the recording's file name, its sha256, length and rate), transcript, the tokenizer's
    fingerprint and name, the codes' shape and sha256; no server path."""
    source = record.get("source") or {}
    tokenizer = record.get("tokenizer") or {}
    label = str(source.get("path") or "")
    return {"name": record.get("name"), "format": record.get("format"),
            "created_at": record.get("created_at"),
            "source": {"path": label if label.startswith("upload:") else Path(label).name,
                       "sha256": source.get("sha256"), "seconds": source.get("seconds"),
                       "sample_rate": source.get("sample_rate")},
            "transcript": record.get("transcript"),
            "tokenizer": {"id": tokenizer.get("id"), "name": _shown_name(tokenizer)},
            "codes": record.get("codes")}


def _shown_name(tokenizer: dict) -> str | None:
    """The tokenizer's name as the user gave it (a preset, a Hub id), or a directory's last
    part when that name was a path."""
    name = tokenizer.get("name")
    if not isinstance(name, str):
        return None
    if name == tokenizer.get("path") or name.startswith(("/", "~", ".")) or "\\" in name:
        return Path(name.rstrip("/")).name or None
    return name


_ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"(),;:]+/)*[^\s/'\"(),;:]*")


def client_message(message: str, server=None, **fields: str) -> str:
    """An error message fit for a client: the store folder said as "the voice store" (its
    files by their names), the tokenizer by its name, `fields` (the words the server's own
    messages use for a client's field) replaced, and any other absolute path as "a server
    path"."""
    pairs = []
    store = getattr(getattr(getattr(server, "tts", None), "voices", None), "root", None)
    if store is not None:
        for root in dict.fromkeys((str(store), str(Path(store).resolve()))):
            pairs += [(f"voice store {root}", "the voice store"), (root + "/", ""),
                      (root, "the voice store")]
    tok = getattr(getattr(server, "tts", None), "tok_ref", None)
    if tok is not None and getattr(tok, "path", None):
        pairs.append((str(tok.path), _shown_name({"name": str(tok.path)}) or "the tokenizer"))
    pairs += list(fields.items())
    for old, new in pairs:
        message = message.replace(old, new)
    return _ABSOLUTE.sub("a server path", message)


def _fields() -> dict[str, str]:
    """The CLI's words in store messages -> the upload form's fields."""
    return {"give --overwrite (overwrite=True)": "send overwrite=true",
            "add one with `mimo-tts voices add NAME FILE`": "upload one",
            "; add it again": "; upload it again"}


def _param(message: str) -> str | None:
    if "voice name" in message or "already exists" in message:
        return "name"
    if "uploaded file" in message or "recording" in message or "prompt audio" in message:
        return "file"
    return None
