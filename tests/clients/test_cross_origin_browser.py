"""A server without `--api-key` against the web pages its user opens (issue 32 item 15), in a
real browser: headless Chromium, with two made-up names resolved to 127.0.0.1
(`--host-resolver-rules`), opens a page of another origin (`attacker.test`, served here) that
uploads a voice (a `no-cors` multipart fetch and a submitted HTML form, as any page can) and asks
for speech with a `text/plain` body; none of it reaches the server. A page whose DNS name points
at 127.0.0.1 (`rebind.test`) cannot read the API. The server's own page still speaks."""

from __future__ import annotations

import functools
import http.server
import io
import threading

import numpy as np
import pytest

from tests.clients.browser import CHROMEDRIVER, CHROMIUM, MISSING, WAIT_S, chromium, speak

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium.webdriver")
sf = pytest.importorskip("soundfile")

pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=MISSING)
RULES = "--host-resolver-rules=MAP attacker.test 127.0.0.1, MAP rebind.test 127.0.0.1"
ATTACK = """<!doctype html><html><body>
<form id="form" method="post" enctype="multipart/form-data" target="sink">
  <input name="name" value="planted-by-form"><input id="file" type="file" name="file">
</form><iframe name="sink" id="sink"></iframe>
<script>
const target = new URLSearchParams(location.search).get("target");
async function attack() {
  const wav = await (await fetch("voice.wav")).blob();
  const sent = [];
  const form = new FormData();
  form.append("name", "planted-by-fetch");
  form.append("file", wav, "voice.wav");
  const speech = JSON.stringify({model: "tiny", input: "Planted speech."});
  for (const [path, body] of [["/v1/audio/voices", form], ["/v1/audio/speech", speech]]) {
    try {
      await fetch(target + path, {method: "POST", mode: "no-cors", body});
      sent.push("sent");
    } catch (error) {
      sent.push("failed");
    }
  }
  const files = new DataTransfer();
  files.items.add(new File([wav], "voice.wav", {type: "audio/wav"}));
  document.getElementById("file").files = files.files;
  const html = document.getElementById("form");
  html.action = target + "/v1/audio/voices";
  document.getElementById("sink").onload = () => { document.title = "done " + sent; };
  html.submit();
}
attack();
</script></body></html>"""


def _wav() -> bytes:
    buffer = io.BytesIO()
    noise = 0.1 * np.random.default_rng(0).standard_normal(16000)
    sf.write(buffer, noise.astype("float32"), 16000, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def url(start_server, tmp_path_factory):
    store = tmp_path_factory.mktemp("cross-origin") / "store"
    return start_server(env={"MIMO_TTS_VOICES_DIR": str(store)})


@pytest.fixture(scope="module")
def attacker(tmp_path_factory):
    """Another origin: a plain file server on its own port, its page and a recording."""
    root = tmp_path_factory.mktemp("attacker")
    (root / "attack.html").write_text(ATTACK, encoding="utf-8")
    (root / "voice.wav").write_bytes(_wav())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://attacker.test:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    driver = chromium(RULES)
    yield driver
    driver.quit()


def test_a_page_of_another_origin_cannot_upload_a_voice_or_make_it_speak(url, attacker,
                                                                        browser):
    from selenium.webdriver.support.wait import WebDriverWait

    before = httpx.get(url + "/health", timeout=10).json()["requests"]
    browser.get(f"{attacker}/attack.html?target={url}")
    WebDriverWait(browser, WAIT_S).until(lambda b: b.title.startswith("done"))
    assert browser.title == "done sent,sent"  # the browser did send all three
    voices = httpx.get(url + "/v1/audio/voices", timeout=10).json()["voices"]
    assert voices == ["default", "natural"]
    assert httpx.get(url + "/health", timeout=10).json()["requests"] == before


def test_a_name_rebound_to_this_machine_cannot_read_the_api(url, browser):
    from selenium.webdriver.common.by import By

    port = url.rsplit(":", 1)[1]
    browser.get(f"http://rebind.test:{port}/v1/audio/voices")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "host_not_allowed" in body and '"voices"' not in body
    browser.get(f"http://localhost:{port}/v1/audio/voices")  # a name the server is bound to
    assert '"voices"' in browser.find_element(By.TAG_NAME, "body").text


def test_the_servers_own_page_still_speaks(url, browser):
    browser.get(url + "/")
    result = speak(browser, "Same origin, no key.", "wav")
    assert result["state"] == "done", result["text"]
    assert result["played"] > 0
