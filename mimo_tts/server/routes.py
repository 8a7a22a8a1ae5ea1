"""The routes of `mimo-tts serve`, on one `APIRouter`; each handler finds its server in
`app.state.server` (a `SpeechServer`, `app.py`). Imported only when the app is built: FastAPI
is the optional `serve` extra."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from mimo_tts.server import voices
from mimo_tts.server.page import speech_openapi
from mimo_tts.server.protocol import ApiError, served_formats


def server_of(request: Request):
    """The `SpeechServer` this request reached."""
    return request.app.state.server


def authorize(request: Request) -> None:
    """The bearer token, when the server has one (401 otherwise)."""
    if not server_of(request).authorized(request):
        raise ApiError(401, "missing or invalid API key (Authorization: Bearer ...)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


# The body each POST route takes, refused otherwise on a server without a key (`guard.py`)
BODY_TYPES = {"/v1/audio/speech": "application/json", "/v1/audio/voices": "multipart/form-data"}
DOCS_ASSETS = "/docs/assets"  # Swagger UI's script and style, served from the package
router = APIRouter()
keyed = APIRouter(dependencies=[Depends(authorize)])


@keyed.post("/v1/audio/speech", openapi_extra=speech_openapi(served_formats()))
async def speech(request: Request):
    return await server_of(request).speech(request)


@keyed.get("/v1/models")
def models(request: Request):
    return JSONResponse(server_of(request).models())


@keyed.get("/v1/audio/voices")
def list_voices(request: Request):
    return JSONResponse(voices.list_voices(server_of(request)))


@keyed.post("/v1/audio/voices")
async def add_voice(request: Request):
    return JSONResponse(await voices.add_voice(server_of(request), request), 201)


@keyed.delete("/v1/audio/voices/{name}")
def delete_voice(request: Request, name: str):
    return JSONResponse(voices.delete_voice(server_of(request), name))


@keyed.get("/metrics", include_in_schema=False)
def metrics(request: Request):
    return server_of(request).metrics.response()


@router.get("/", include_in_schema=False)
def page(request: Request):
    return server_of(request).page()


@router.get("/health")
def health(request: Request):
    return JSONResponse(server_of(request).health())


def build_app(server) -> FastAPI:
    """The FastAPI app of `server`: its routes, errors as OpenAI-style JSON bodies, and `/docs`
    (Swagger UI) from the assets fastapi-offline ships, so it works with no network."""
    app = FastAPIOffline(title="mimo-tts", redoc_url=None, static_url=DOCS_ASSETS)
    app.state.server = server
    app.add_exception_handler(ApiError, lambda request, exc: exc.response())
    app.add_exception_handler(HTTPException, lambda request, exc: ApiError(
        exc.status_code, str(exc.detail)).response())
    app.add_exception_handler(Exception, lambda request, exc: ApiError(
        500, f"unexpected {type(exc).__name__}: {voices.client_message(str(exc), server)}")
        .response())
    app.include_router(keyed)
    app.include_router(router)
    return app
