"""Clients nobody here wrote, against real server processes: Debian's Chromium (headless,
through selenium and chromedriver) on the page of `mimo-tts serve`, and `wyoming-bench` on
`mimo-tts wyoming`. Each test skips when its client is not installed (`.ci/run` installs both:
wyoming-bench from PyPI, Chromium from Debian's packages); the servers come from
tests/server/conftest.py's `start_server`."""

from tests.server.conftest import start_server  # noqa: F401 (the fixtures, shared)
from tests.wyoming.conftest import start_wyoming  # noqa: F401
