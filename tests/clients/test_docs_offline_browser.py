"""`/docs` on a machine without internet (issue 32 item 12): headless Chromium, every DNS name
unresolvable (`--host-resolver-rules`: a CDN cannot load), renders Swagger UI from the
server's own assets and lists the speech route; the HTML names no other host."""

from __future__ import annotations

import re

import pytest

from tests.clients.browser import CHROMEDRIVER, CHROMIUM, MISSING, chromium

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium.webdriver")

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=MISSING)
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"  # only this machine
RENDER_S = 30


@pytest.fixture(scope="module")
def url(start_server):
    return start_server()


def test_docs_render_with_no_network(url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.wait import WebDriverWait

    html = httpx.get(url + "/docs", timeout=10).text
    assert not re.search(r"""(src|href)=["']?https?://""", html), html
    browser = chromium(OFFLINE)
    try:
        browser.get(url + "/docs")
        WebDriverWait(browser, RENDER_S).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
        paths = [e.text for e in browser.find_elements(By.CSS_SELECTOR,
                                                       ".opblock-summary-path")]
        assert "/v1/audio/speech" in paths
        title = browser.find_element(By.CSS_SELECTOR, ".info .title").text
        assert title.startswith("mimo-tts")
    finally:
        browser.quit()
