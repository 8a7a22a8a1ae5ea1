"""`/v1/audio/voices`: the voice registry over HTTP (list, upload, delete).

An upload is multipart form data: `name`, `file` (the recording), optionally `transcript` and
`overwrite`. The body is refused past `MAX_VOICE_BYTES` (413) and the recording past
`MAX_VOICE_SECONDS` (400) before anything is encoded; it is encoded once, as a `--prompt-audio`
file would be, and kept in the same store as `mimo-tts voices add`. A request already admitted
built its prompt from the codes it found, so a voice replaced or deleted meanwhile does not
change it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from mimo_tts.errors import InputError, MimoTTSError, UsageError
from mimo_tts.server.protocol import MAX_VOICE_BYTES, MAX_VOICE_SECONDS, ApiError, read_body
from mimo_tts.synthesis.voices import check_name

BUILT_IN = ("default", "natural")


def list_voices(server) -> dict:
    """Every voice a request may name: built-in, start-up (`--voice`) and registry voices."""
    data = [{"name": n, "kind": "builtin"} for n in BUILT_IN]
    data += [{"name": n, "kind": "startup"} for n in server.cfg.voices]
    for record in server.tts.voices.list():
        entry = {"name": record["name"], "kind": "registry"}
        if "error" in record:
            entry["error"] = record["error"]
        else:
            entry.update(seconds=record["source"]["seconds"], created_at=record["created_at"],
                         transcript=record.get("transcript"))
        data.append(entry)
    return {"object": "list", "voices": [d["name"] for d in data], "data": data}


async def add_voice(server, request) -> dict:
    """A multipart upload -> a stored voice (its record)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request

    body = await read_body(request, MAX_VOICE_BYTES)

    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=1, max_fields=8)
    except Exception as exc:  # noqa: BLE001 (the multipart parser's errors have no one base)
        raise ApiError(400, f"the upload is not multipart form data: {exc}") from None
    upload, name = form.get("file"), form.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "the upload needs a name field", "name")
    if upload is None or isinstance(upload, str):
        raise ApiError(400, "the upload needs a file field holding the recording", "file")
    transcript = form.get("transcript")
    overwrite = str(form.get("overwrite", "")).lower() in ("1", "true", "yes")
    data = await upload.read()
    label = f"upload:{Path(upload.filename or 'voice').name}"
    try:
        return await run_in_threadpool(_encode, server.tts, name, data, transcript, overwrite,
                                       label)
    except MimoTTSError as exc:
        raise ApiError.of(exc) from None


def _encode(tts, name: str, data: bytes, transcript, overwrite: bool, label: str) -> dict:
    import soundfile as sf

    check_name(name)  # before any decoding
    with tempfile.TemporaryDirectory(prefix="mimo-voice-") as folder:
        path = Path(folder) / "upload"
        path.write_bytes(data)
        try:
            seconds = sf.info(str(path)).duration
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise InputError(f"the uploaded file is unreadable or unsupported: "
                             f"{str(exc).splitlines()[0] if str(exc) else exc}") from None
        if seconds > MAX_VOICE_SECONDS:
            raise UsageError(f"the recording is {seconds:.1f} s; a voice takes at most "
                             f"{MAX_VOICE_SECONDS:g} s")
        return tts.add_voice(name, path, transcript if isinstance(transcript, str) else None,
                             overwrite, label)


def delete_voice(server, name: str) -> dict:
    try:
        server.tts.voices.remove(name)
    except MimoTTSError as exc:
        error = ApiError.of(exc)
        if "unknown voice" in str(exc):
            error.status = 404
        raise error from None
    return {"name": name, "deleted": True}
