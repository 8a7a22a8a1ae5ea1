"""What `mimo-tts serve` without `--api-key` refuses: requests a web page makes, not its user.

Without a key, whatever reaches the port may call the API, and a browser makes every page its
user opens such a caller: a page of any site can POST a multipart form (a voice upload) or a
`text/plain` body (a speech request) to 127.0.0.1 without asking, and a page whose DNS name it
rebinds to 127.0.0.1 can even read the answers. So, without a key (with one, no page can send
it), before any route runs:

- the `Host` must be a name of this server: localhost, 127.0.0.1, [::1], `--host`, a name
  given with `--allowed-host`, and (bound to every address) any IP address, which no DNS
  answer can rebind; else 403 `host_not_allowed`;
- a write (any method but GET, HEAD, OPTIONS) from another origin is 403 `cross_origin`: an
  `Origin` that is not this server's own, or a `Sec-Fetch-Site` other than `same-origin` (a
  page of this server) and `none` (typed by the user);
- a body must be of the type its route takes (`body_types`): 415 `unsupported_media_type`.

The page at `/` and `/docs` send same-origin JSON, and non-browser clients send no `Origin`.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from mimo_tts.server.protocol import ApiError, ServeConfig

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")  # bound to every address
READS = ("GET", "HEAD", "OPTIONS")
SAME_SITE_FETCHES = ("same-origin", "none")


def host_name(value: str) -> str:
    """A `Host` header's name: lower case, without its port, brackets or final dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:  # name:8000 (a bare IPv6 address keeps its colons)
        value = value.partition(":")[0]
    value = value.rstrip(".")
    try:
        return str(ipaddress.ip_address(value))  # one spelling of each address
    except ValueError:
        return value


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """The refusals above for one server's options; `refusal` decides, `wrap` applies."""

    def __init__(self, cfg: ServeConfig, body_types: dict[str, str]):
        self.names = {host_name(n) for n in (*LOOPBACK_NAMES, cfg.host, *cfg.allowed_hosts)}
        self.names.discard("")
        self.any_address = cfg.host in WILDCARDS
        self.body_types = body_types  # path of a POST route -> the media type it takes

    def allows_host(self, value: str | None) -> bool:
        """Whether a `Host` names this server (none at all: not a browser, which always
        sends one)."""
        if value is None:
            return True
        name = host_name(value)
        return name in self.names or (self.any_address and _is_address(name))

    def refusal(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        """Why a request is refused (`headers` by lower-case name), or None."""
        host = headers.get("host")
        if not self.allows_host(host):
            shown = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.names))
            return ApiError(403, f"Host {host_name(host)!r} is not a name of this server "
                            f"(it answers to {shown}); start it with --allowed-host NAME, or "
                            "with --api-key", code="host_not_allowed")
        if method.upper() in READS:
            return None
        site, origin = headers.get("sec-fetch-site"), headers.get("origin")
        if site is not None and site not in SAME_SITE_FETCHES or \
                origin is not None and urlsplit(origin).netloc.lower() != (host or "").lower():
            return ApiError(403, f"a {method.upper()} from another web page ({origin or site}) "
                            "is refused: this server has no API key", code="cross_origin")
        wanted = self.body_types.get(path)
        given = headers.get("content-type", "").partition(";")[0].strip().lower()
        if wanted is not None and given != wanted:
            return ApiError(415, f"the body must be {wanted}, not {given or 'untyped'}",
                            code="unsupported_media_type")
        return None

    def wrap(self, app):
        """The ASGI `app` behind these refusals (HTTP requests; a refusal is a JSON error)."""
        async def guarded(scope, receive, send) -> None:
            if scope["type"] == "http":
                headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                           for k, v in scope["headers"]}
                error = self.refusal(scope["method"], scope["path"], headers)
                if error is not None:
                    return await error.response()(scope, receive, send)
            await app(scope, receive, send)

        return guarded
