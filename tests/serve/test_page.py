"""The page of `ringctx serve` (ringctx/serve/static/) in a real browser: headless Chromium driven by selenium.

Two servers, each started once for the module, and one browser for every test:
- a live `ringctx serve --nproc 1` with the embedded SmolLM2: a needle document goes in through the
  page's file input, its ingest is watched to the end, and the answer streamed into the page must
  hold the needle and equal the server's own greedy answer, as must a follow-up's to the conversation;
- the app over the fake backend of test_app.py, with an API key, answering markup: the key is asked
  for, a wrong key shows an error, markup is shown as text and never runs, a follow-up sends the
  conversation before it (as the backend received it), a narrow window fits.

Chromium and its driver are Debian's (`apt-get install chromium chromium-driver`, as .ci/run does),
with the system chromedriver (selenium never downloads one). When they are missing the tests fail
saying what to install; RINGCTX_SKIP_BROWSER_TESTS=1 skips them instead (for a developer's machine).
Set RINGCTX_PAGE_SCREENSHOT=docs/page.png to save the page after its follow-up (the README's picture).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading

import pytest

from ringctx.serve import backend as api

from .test_app import KEY, FakeBackend
from .test_live_server import DOCUMENT, NEEDLE, QUESTION, Server

WAIT_S = 60          # a page element the fake backend fills
INGEST_WAIT_S = 600  # the live ingest of DOCUMENT on one rank (bounded; normally seconds)
ANSWER_WAIT_S = 300
MARKUP = '<script>window.__injected = "script"</script><img src="x" onerror="window.__injected = \'img\'">'


def _need_browser():
    """selenium's webdriver module, or a failure naming what to install (a skip when asked for)."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
        missing.append("selenium (pip)")
    if missing:
        why = (f"the browser tests need {', '.join(missing)}: apt-get install -y chromium chromium-driver; "
               "pip install selenium (the test extra)")
        if os.environ.get("RINGCTX_SKIP_BROWSER_TESTS") == "1":
            pytest.skip(why)
        pytest.fail(why + "; or set RINGCTX_SKIP_BROWSER_TESTS=1 to skip them", pytrace=False)
    return webdriver


@pytest.fixture(scope="module")
def browser():
    webdriver = _need_browser()
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`ringctx serve` on one rank, documents in chunks of 512 tokens (several chunks to watch)."""
    server = Server(tmp_path_factory.mktemp("store"), "--chunk-tokens", "512", nproc=1)
    yield server
    assert server.stop() == 0, "".join(server.lines)[-3000:]


INGESTING = "doc-" + "1" * 24


class MarkupBackend(FakeBackend):
    """The fake backend, answering markup, with one document held in the middle of its ingest."""

    def __init__(self):
        super().__init__()
        self.docs[INGESTING] = api.DocumentInfo(
            id=INGESTING, name="half read", status="ingesting", created=1, tokens=3_000, chunks_done=1, chunks_total=3,
            chunk_strategies=["pass-kv"], chunk_seconds=[2.5], chunk_tokens=[1_024], seconds=2.5, eta_s=20.0,
            tokens_per_s=409.6)

    def generate(self, request):
        answer = super().generate(request)
        answer.words = [MARKUP[:40], MARKUP[40:]]
        return answer


@pytest.fixture(scope="module")
def fake_backend():
    return MarkupBackend()


@pytest.fixture(scope="module")
def fake(fake_backend):
    """The app over MarkupBackend with API key KEY, served by uvicorn on a loopback port: its URL."""
    import uvicorn

    from ringctx.serve.app import create_app
    from ringctx.serve.server import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(fake_backend, api_key=KEY, log=lambda line: None),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    host, port = sock.getsockname()[:2]
    yield f"http://{host}:{port}"
    server.should_exit = True
    thread.join(timeout=WAIT_S)
    sock.close()


# ---------------------------------------------------------------------------- helpers
def wait_for(driver, condition, timeout=WAIT_S, what="the page"):
    """Wait (bounded) until condition(driver) is true; a timeout fails naming what and the errors shown."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # an element the page re-renders between two reads (the document menu's refresh) is read again
        return WebDriverWait(driver, timeout, poll_frequency=0.1,
                             ignored_exceptions=(StaleElementReferenceException,)).until(condition)
    except TimeoutException:
        raise AssertionError(f"{what}: not seen after {timeout} s; errors on the page: {errors_shown(driver)!r}") from None


def by_id(driver, element_id):
    return driver.find_element("id", element_id)


def errors_shown(driver) -> list[str]:
    return [e.text for e in driver.find_elements("css selector", "#errors .error span")]


def open_page(driver, url, key=None):
    """Load the page in a fresh tab state; with `key`, give it when the page asks."""
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/")
    if key is not None:
        give_key(driver, key)


def give_key(driver, key):
    wait_for(driver, lambda d: by_id(d, "key-form").is_displayed(), what="the API key form")
    by_id(driver, "key-input").send_keys(key)
    by_id(driver, "key-button").click()


def set_value(driver, element_id, text):
    """A pasted value (send_keys would type it key by key)."""
    driver.execute_script("document.getElementById(arguments[0]).value = arguments[1]", element_id, text)


def ask(driver, question, max_tokens, document=None):
    """Ask on the page (a follow-up when a conversation is going on); the answer's text and its stats
    line once the stream has ended (the newest turn's: #answer and #answer-stats)."""
    from selenium.webdriver.support.ui import Select

    if document is not None:
        wait_for(driver, lambda d: document in d.execute_script(
            "return [...document.getElementById('ask-doc').options].map((o) => o.value)"),
                 what=f"{document} in the question's document menu")
        wait_for(driver, lambda d: Select(by_id(d, "ask-doc")).select_by_value(document) or True,
                 what=f"{document} chosen in the question's document menu")
    set_value(driver, "question", question)
    set_value(driver, "max-tokens", str(max_tokens))
    by_id(driver, "ask-button").click()
    wait_for(driver, lambda d: by_id(d, "answer").get_attribute("data-state") in ("done", "error"),
             timeout=ANSWER_WAIT_S, what="the end of the streamed answer")
    assert by_id(driver, "answer").get_attribute("data-state") == "done", errors_shown(driver)
    answer = driver.execute_script("return document.getElementById('answer').textContent")
    return answer, by_id(driver, "answer-stats").text


def turns_shown(driver) -> list[tuple[str, str]]:
    """The conversation on the page, oldest first: (question, answer) of each turn as shown."""
    return [tuple(driver.execute_script("return arguments[0].textContent", turn.find_element("css selector", part))
                  for part in (".question", ".answer"))
            for turn in driver.find_elements("css selector", "#turns .turn")]


# ---------------------------------------------------------------------------- the live server
def test_a_needle_document_ingested_and_asked_on_the_page(browser, live, tmp_path):
    open_page(browser, live.url)
    wait_for(browser, lambda d: "smollm2" in by_id(d, "model").text, what="the model's name in the header")
    path = tmp_path / "needle.txt"
    path.write_text(DOCUMENT)
    by_id(browser, "file").send_keys(str(path))  # the file input's change: a multipart upload

    wait_for(browser, lambda d: by_id(d, "p-status").get_attribute("data-status") not in (None, "", "ingesting"),
             timeout=INGEST_WAIT_S, what="the end of the ingest in the page's ingest view")
    doc_id = by_id(browser, "p-id").text
    assert by_id(browser, "p-status").get_attribute("data-status") == "ready", errors_shown(browser)
    doc = live.http.get(f"/v1/documents/{doc_id}").json()
    assert doc["name"] == "needle.txt" and doc["chunks"]["total"] >= 2
    # The ingest view shows what the API says: every chunk's strategy and tokens, the rate, KV per rank.
    wait_for(browser, lambda d: len(d.find_elements("css selector", "#p-chunk-table tbody tr")) == doc["chunks"]["total"],
             what="a row per chunk")
    rows = [[td.text for td in tr.find_elements("tag name", "td")]
            for tr in browser.find_elements("css selector", "#p-chunk-table tbody tr")]
    assert [r[1] for r in rows] == doc["chunks"]["strategies"]
    assert [int(r[2].replace(",", "")) for r in rows] == doc["chunks"]["tokens"]
    assert by_id(browser, "p-chunks").text == f"{doc['chunks']['total']} of {doc['chunks']['total']}"
    assert by_id(browser, "p-rate").text == f"{math.floor(doc['tokens_per_s'] + 0.5):,}"  # JS Math.round
    assert by_id(browser, "p-kv").text.startswith("rank 0: ") and "B" in by_id(browser, "p-kv").text
    # The list is refreshed on its own poll: it may show the end of the ingest a moment later.
    row = f'#doc-table tr[data-id="{doc_id}"][data-status="ready"]'
    wait_for(browser, lambda d: d.find_elements("css selector", row), what="the document ready in the list")
    assert f"{doc['tokens']:,}" in browser.find_element("css selector", row).text

    answer, stats = ask(browser, QUESTION, 16, document=doc_id)
    assert "7492" in NEEDLE and "7492" in answer, answer
    # The page shows exactly the server's answer (greedy, the same question and limit, not streamed).
    assert answer == live.ask(doc_id, QUESTION).choices[0].message.content
    assert re.search(r"first token after \d+\.\d\d s · \d+ tokens · \d+\.\d tokens/s · "
                     rf"{doc['tokens']:,} prompt tokens from the cache", stats), stats
    assert errors_shown(browser) == []

    # A follow-up continues the conversation: the page sends the first turn before it, so its answer
    # is the server's to the whole conversation, with the document's KV (at least) from the cache.
    follow_up = "Who knows it?"
    second, stats = ask(browser, follow_up, 8)
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": follow_up}]
    reference = live.client.chat.completions.create(model="smollm2-135m", messages=conversation,
                                                    extra_body={"document": doc_id}, max_tokens=8, temperature=0)
    assert second == reference.choices[0].message.content
    assert turns_shown(browser) == [(QUESTION, answer), (follow_up, second)]
    cached = re.search(r"([\d,]+) prompt tokens from the cache", stats)
    assert cached and int(cached[1].replace(",", "")) >= doc["tokens"], stats
    assert errors_shown(browser) == []
    if os.environ.get("RINGCTX_PAGE_SCREENSHOT"):
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(os.environ["RINGCTX_PAGE_SCREENSHOT"])


def test_delete_removes_the_document_from_the_page(browser, live):
    open_page(browser, live.url)
    doc_id = live.ingest("A short note about nothing in particular.", name="to delete")["id"]
    live.wait_ready(doc_id)
    selector = f'#doc-table tr[data-id="{doc_id}"]'
    wait_for(browser, lambda d: d.find_elements("css selector", selector), what="the document's row")
    button = browser.find_element("css selector", f"{selector} button.danger")
    button.click()
    assert button.text == "sure?"  # a second click deletes
    button.click()
    wait_for(browser, lambda d: not d.find_elements("css selector", selector), what="the row gone after delete")
    assert live.http.get(f"/v1/documents/{doc_id}").status_code == 404


# ---------------------------------------------------------------------------- the fake backend
def test_a_wrong_api_key_shows_an_error_and_the_page_asks_again(browser, fake):
    open_page(browser, fake, key="not-the-key")
    wait_for(browser, lambda d: errors_shown(d), what="an error for the wrong key")
    assert any("the API key is not valid" in e for e in errors_shown(browser)), errors_shown(browser)
    assert by_id(browser, "key-form").is_displayed() and by_id(browser, "ingest").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('ringctx.apiKey')") is None
    give_key(browser, KEY)
    wait_for(browser, lambda d: "fake-model" in by_id(d, "model").text, what="the model once the key is right")
    assert errors_shown(browser) == [] and not by_id(browser, "key-form").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('ringctx.apiKey')") == KEY


def test_markup_in_a_document_name_and_an_answer_is_shown_as_text(browser, fake):
    open_page(browser, fake, key=KEY)
    set_value(browser, "doc-name", MARKUP)
    set_value(browser, "doc-text", "text " + MARKUP)
    by_id(browser, "ingest-button").click()
    wait_for(browser, lambda d: by_id(d, "p-name").text == MARKUP, what="the document's name in the ingest view")
    name = f'#doc-table tr[data-id="{by_id(browser, "p-id").text}"] td.name'
    wait_for(browser, lambda d: d.find_elements("css selector", name), what="the document's row")
    assert browser.find_element("css selector", name).text == MARKUP

    answer, _ = ask(browser, "What is in it?", 10, document=by_id(browser, "p-id").text)
    assert answer == MARKUP
    assert browser.execute_script("return window.__injected") is None  # neither the script nor onerror ran
    assert browser.find_elements("css selector", "main script, main img") == []
    assert errors_shown(browser) == []


def test_an_ingest_in_progress_shows_its_chunks_eta_and_rate(browser, fake):
    open_page(browser, fake, key=KEY)
    view = f'#doc-table tr[data-id="{INGESTING}"] button'
    wait_for(browser, lambda d: d.find_elements("css selector", view), what="the ingesting document's row")
    browser.find_element("css selector", view).click()  # its "view" button
    wait_for(browser, lambda d: by_id(d, "p-id").text == INGESTING, what="the ingest view of the document")
    facts = {key: by_id(browser, f"p-{key}").text for key in ("status", "chunks", "tokens", "time", "eta", "rate", "kv")}
    assert facts == {"status": "ingesting 1/3", "chunks": "1 of 3", "tokens": "3,000", "time": "2.50 s", "eta": "20.0 s",
                     "rate": "410", "kv": "after the hand-off"}
    # The bar counts work as the ETA does: 2.5 s done of 2.5 + 20 s.
    assert float(by_id(browser, "p-bar").get_attribute("value")) == pytest.approx(2.5 / 22.5, abs=1e-6)
    rows = [[td.text for td in tr.find_elements("tag name", "td")]
            for tr in browser.find_elements("css selector", "#p-chunk-table tbody tr")]
    assert rows == [["1", "pass-kv", "1,024", "2.50"]]
    assert INGESTING not in [o.get_attribute("value") for o in browser.find_elements("css selector", "#ask-doc option")]


def test_an_error_from_the_server_is_shown_as_a_message(browser, fake):
    open_page(browser, fake, key=KEY)
    set_value(browser, "doc-text", "x" * 3_001)  # the fake refuses documents over 3,000 characters (413)
    by_id(browser, "ingest-button").click()
    wait_for(browser, lambda d: errors_shown(d), what="the refusal shown")
    assert errors_shown(browser) == ["could not ingest: the document has 3,001+ tokens; this server keeps at most 3,000"]


def drop_file(driver, name, text):
    """Drop a file named `name` holding `text` on the page's drop zone (a drop event, as a user's)."""
    driver.execute_script("""
        const transfer = new DataTransfer();
        transfer.items.add(new File([arguments[1]], arguments[0], {type: "text/plain"}));
        const zone = document.getElementById("drop");
        for (const type of ["dragover", "drop"])
          zone.dispatchEvent(new DragEvent(type, {dataTransfer: transfer, bubbles: true, cancelable: true}));
        """, name, text)


def test_a_dropped_file_is_ingested_and_only_text_files_are_taken(browser, fake, fake_backend):
    open_page(browser, fake, key=KEY)
    drop_file(browser, "notes.md", "# Notes\nfirst second third")
    wait_for(browser, lambda d: by_id(d, "p-name").text == "notes.md", what="the dropped file's ingest")
    ingested = fake_backend.docs[by_id(browser, "p-id").text]
    assert ingested.name == "notes.md" and ingested.tokens == 5  # the fake counts words: the file's text arrived
    drop_file(browser, "report.pdf", "%PDF-1.7")
    wait_for(browser, lambda d: errors_shown(d), what="the refusal of a .pdf")
    assert errors_shown(browser) == ["report.pdf is not a .txt or .md file: give plain text"]
    assert "report.pdf" not in [d.name for d in fake_backend.docs.values()]


def test_an_error_in_the_middle_of_an_answer_is_shown_after_its_first_words(browser, fake, fake_backend):
    open_page(browser, fake, key=KEY)
    fake_backend.fail_after = 1  # the stream's error event after one piece (a rank lost)
    try:
        set_value(browser, "question", "Go on.")
        by_id(browser, "ask-button").click()
        wait_for(browser, lambda d: by_id(d, "answer").get_attribute("data-state") == "error", what="the answer's error")
    finally:
        fake_backend.fail_after = None
    assert by_id(browser, "answer").text == MARKUP[:40]
    assert errors_shown(browser) == ["could not answer: rank 1 of 2 has exited (code -9)"]
    assert by_id(browser, "ask-button").is_enabled() and not by_id(browser, "stop-button").is_enabled()


def test_a_follow_up_sends_the_conversation_and_new_conversation_clears_it(browser, fake, fake_backend):
    open_page(browser, fake, key=KEY)
    doc_id = fake_backend.add_document("a note of five words", name="note").id
    assistant = {"role": "assistant", "content": MARKUP}  # every answer of MarkupBackend

    def user(text):
        return {"role": "user", "content": text}

    assert ask(browser, "What is it?", 10, document=doc_id)[0] == MARKUP
    assert fake_backend.requests[-1].messages == (user("What is it?"),)
    answer, stats = ask(browser, "And then?", 10)
    assert answer == MARKUP and stats.endswith("5 prompt tokens from the cache")  # the fake's: the document's
    request = fake_backend.requests[-1]
    assert request.messages == (user("What is it?"), assistant, user("And then?")) and request.document == doc_id
    assert turns_shown(browser) == [("What is it?", MARKUP), ("And then?", MARKUP)]
    stats_lines = [e.text for e in browser.find_elements("css selector", "#turns .turn .answer-stats")]
    assert len(stats_lines) == 2 and all("prompt tokens from the cache" in line for line in stats_lines), stats_lines
    assert len(browser.find_elements("css selector", "#answer, #answer-stats")) == 2  # the newest turn's only

    # A failed answer is shown but not kept: the next question follows the turns before it.
    fake_backend.fail_after = 1
    try:
        set_value(browser, "question", "Lost?")
        by_id(browser, "ask-button").click()
        wait_for(browser, lambda d: by_id(d, "answer").get_attribute("data-state") == "error", what="the answer's error")
    finally:
        fake_backend.fail_after = None
    assert len(turns_shown(browser)) == 3
    by_id(browser, "errors").find_element("css selector", ".error button").click()  # dismissed
    ask(browser, "Third?", 10)
    assert fake_backend.requests[-1].messages == (user("What is it?"), assistant, user("And then?"), assistant,
                                                  user("Third?"))
    assert [q for q, _ in turns_shown(browser)] == ["What is it?", "And then?", "Third?"]  # the failed one gone

    by_id(browser, "new-conversation").click()
    assert turns_shown(browser) == [] and not by_id(browser, "new-conversation").is_enabled()
    ask(browser, "Anew?", 10)
    assert fake_backend.requests[-1].messages == (user("Anew?"),) and fake_backend.requests[-1].document == doc_id

    # Another document in the menu starts a new conversation, about that one.
    from selenium.webdriver.support.ui import Select

    Select(by_id(browser, "ask-doc")).select_by_value("")
    assert turns_shown(browser) == []
    ask(browser, "Nothing?", 10)
    assert fake_backend.requests[-1].messages == (user("Nothing?"),) and fake_backend.requests[-1].document is None
    assert errors_shown(browser) == []


def test_the_page_fits_a_narrow_window(browser, fake):
    browser.set_window_size(400, 900)
    try:
        open_page(browser, fake, key=KEY)
        wait_for(browser, lambda d: "fake-model" in by_id(d, "model").text, what="the loaded page")
        width = browser.execute_script("return document.documentElement.clientWidth")
        assert width <= 400
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width  # no sideways scroll
        wait_for(browser, lambda d: d.find_elements("css selector", "#doc-table tbody tr"), what="a document's row")
        for element_id in ("ingest", "documents", "ask", "doc-text", "question", "ask-button", "new-conversation",
                           "ingest-button", "doc-table"):  # the table with its buttons, not only its scrolling box
            rect = browser.execute_script("return document.getElementById(arguments[0]).getBoundingClientRect().toJSON()",
                                          element_id)
            assert 0 <= rect["left"] and rect["right"] <= width, (element_id, rect, width)
    finally:
        browser.set_window_size(1280, 1000)


def test_the_page_and_its_files_need_no_key_and_forbid_other_origins(fake):
    import httpx

    with httpx.Client(base_url=fake) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for path, kind in (("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")):
            r = http.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.text
        assert http.get("/static/../app.py").status_code in (401, 404)
        assert http.get("/v1/documents").status_code == 401  # the API still needs the key
        # Offline: no file of the page names another origin.
        for path in ("/", "/static/app.js", "/static/style.css"):
            assert not re.search(r"(src|href|url)\s*[=(]\s*[\"']?(https?:)?//", http.get(path).text), path
