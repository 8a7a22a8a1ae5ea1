"""The page at `/` in a real browser: headless Chromium loads it, takes the API key once (kept
in localStorage across a reload), submits, plays the streamed wav as it comes and offers the
file; a whole format (flac) plays through the audio element; a wrong key shows the 401."""

from __future__ import annotations

import pytest

from tests.clients.browser import CHROMEDRIVER, CHROMIUM, MISSING, chromium, speak

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium.webdriver")

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=MISSING)
KEY = "browser-key"


@pytest.fixture(scope="module")
def url(start_server):
    return start_server("--api-key", KEY)


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


def test_the_page_streams_wav_keeps_the_key_and_offers_the_file(url, browser):
    from selenium.webdriver.common.by import By

    browser.get(url + "/")
    voices = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#voice option")]
    assert voices == ["default", "natural"]
    result = speak(browser, "Hello from the browser.", "wav", key=KEY)
    assert result["state"] == "done", result["text"]
    assert result["played"] > 0 and result["played"] % 960 == 0  # whole frames, as streamed
    assert result["bytes"] == 44 + 2 * result["played"]  # the file: header + what played
    assert result["href"].startswith("blob:") and result["file"] == "speech.wav"
    # the saved file's header has the real sizes (the stream's were unknown)
    size = browser.execute_async_script(
        "const done = arguments[0];"
        "fetch(document.getElementById('download').href).then(r => r.arrayBuffer())"
        ".then(b => done(new DataView(b).getUint32(40, true)));")
    assert size == 2 * result["played"]
    browser.get(url + "/")  # typed once: the key is still there
    assert browser.find_element(By.ID, "key").get_attribute("value") == KEY


def test_a_whole_format_plays_in_the_audio_element(url, browser):
    browser.get(url + "/")
    result = speak(browser, "A flac answer.", "flac")
    assert result["state"] == "done", result["text"]
    assert result["player"].startswith("blob:") and result["file"] == "speech.flac"
    assert result["bytes"] > 0 and result["played"] == 0


def test_a_wrong_key_shows_the_servers_refusal(url, browser):
    browser.get(url + "/")
    result = speak(browser, "Refused.", "pcm", key="not-the-key")
    assert result["state"] == "error" and "401" in result["text"]
    assert "invalid API key" in result["text"]
