"""`pyedgemoe serve` in a real browser: Debian's chromium, headless, driven by Playwright.

Our page of the expert cache (/experts; / too when llama.cpp's UI is not built): a message sent from
it streams its reply, and the cache's numbers move. llama.cpp's own chat UI at /, when `make ui` has
built it: a message typed into it gets its streamed reply, and its page links to ours.
Skipped, saying why, where chromium (apt-get install chromium) or Playwright is not installed.
PYEDGEMOE_SCREENSHOT=FILE saves the expert cache page after the chat (docs/server.md's picture)."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from test_server import start_server, stop_server

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (make setup-test)")
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; make browser-deps)",
                allow_module_level=True)

from pyedgemoe.server.web_ui import BUILT_UI  # noqa: E402

N_LAYERS = 6  # the demo model's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # mixed precision (the demo's calibration): the precision split has HIGH and LOW
    proc, url = start_server(tmp_path_factory.mktemp("web") / "server.log", "--expert-cache", "25%", "-t", "1",
                             "-c", "1024")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture()
def page(browser):
    page = browser.new_page(viewport={"width": 1200, "height": 760})
    yield page
    page.close()


def sse_text(body: bytes) -> str:
    """The content a chat's server-sent events carry."""
    text = ""
    for event in body.decode().split("\n\n"):
        data = event.removeprefix("data: ").strip()
        if data and data != "[DONE]":
            text += json.loads(data)["choices"][0]["delta"].get("content") or ""
    return text


def test_the_expert_cache_page_streams_a_chat_and_shows_the_cache_move(server, page):
    page.goto(server + "/experts")
    page.wait_for_function("document.querySelectorAll('#layers tr').length > 0")
    assert page.locator("#layers tr").count() == N_LAYERS
    before = int(page.inner_text("#tokens-generated"))

    page.fill("#prompt", "def fibonacci(n):")
    with page.expect_response(re.compile(r"/v1/chat/completions$")) as sent:
        page.click("#send")
    response = sent.value
    assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
    page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=60_000)
    reply = sse_text(response.body())
    assert reply and page.inner_text("#reply") == reply  # the streamed pieces, shown as they came

    # the view follows the cache: the generated tokens, each layer's lookups and the precision split
    page.wait_for_function(f"Number(document.getElementById('tokens-generated').textContent) > {before}")
    lookups = [int(page.locator(f'#layers tr[data-layer="{layer}"] td').nth(1).inner_text())
               for layer in range(N_LAYERS)]
    assert all(n > 0 for n in lookups)
    assert re.fullmatch(r"\d+\.\d %", page.inner_text("#hit-rate"))
    assert re.search(r"high \d+ .*low \d+ .*skip \d+", page.inner_text("#precision"))
    assert "on demand" in page.inner_text("#bytes")
    if os.environ.get("PYEDGEMOE_SCREENSHOT"):
        page.screenshot(path=os.environ["PYEDGEMOE_SCREENSHOT"])


def test_the_root_is_llama_cpp_s_ui_or_else_ours(server, page):
    page.goto(server + "/")
    if (BUILT_UI / "index.html").is_file():
        assert page.locator("a[href='experts']").count() == 1  # its link to ours
    else:
        page.wait_for_selector("#layers tr")


@pytest.mark.skipif(not (BUILT_UI / "index.html").is_file(),
                    reason=f"llama.cpp's web UI is not built in {BUILT_UI} (make ui: npm and its registry)")
def test_llama_cpp_s_ui_chats_with_the_server(server, page):
    page.goto(server + "/")
    box = page.locator("textarea").first
    box.wait_for(timeout=30_000)
    box.fill("def fibonacci(n):")
    with page.expect_response(re.compile(r"/v1/chat/completions$"), timeout=60_000) as sent:
        box.press("Enter")
    response = sent.value
    assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
    words = re.findall(r"[A-Za-z_]{4,}", sse_text(response.body()))
    if words:  # the UI renders Markdown: look for a word of the reply
        page.wait_for_function(f"document.body.innerText.includes({json.dumps(words[0])})", timeout=30_000)
