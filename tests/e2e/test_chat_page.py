"""The chat page at / in a real headless browser (the system's Chromium, driven by Playwright) against a real server
with an API key: the key's question, streaming, Stop (the server sees the client leave), presets, regenerate and
edit, conversations kept across a reload, safe markdown, errors, themes, labels and a phone's width.

A few tests answer /v1/chat/completions from the browser itself (page.route) with a canned event stream: the model
cannot be made to write a <script>, and the page's renderer is what they test."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Route, sync_playwright

from tests.support.chat_page import ANSWER_TIMEOUT_MS, launch, open_page, send, wait_answered
from tests.support.server_process import ServerProcess, start_server, stop_server

MODEL = "smollm2-135m"
KEY = "page-test-key"
KEY_STORAGE = "emberserve.chat.apiKey"
RUNNING = "emberserve:num_requests_running"
ABORTED = 'emberserve:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def page_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # One intra-op thread: steps stay quick on a machine whose cores other processes share (test_openapi_fuzz.py).
    srv = start_server(tmp_path_factory.mktemp("page"), "--model", MODEL, "--api-key", KEY,
                       env={"OMP_NUM_THREADS": "1"})
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def api(page_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=page_server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        try:
            browser = launch(playwright)
        except RuntimeError as e:  # a failure, not a skip: `make test` installs the browser
            pytest.fail(str(e))
        yield browser
        browser.close()


def _context(browser: Browser, key: str | None, **options: Any) -> BrowserContext:
    context = browser.new_context(**{"viewport": {"width": 1280, "height": 800}, "accept_downloads": True, **options})
    if key is not None:  # as if the key had been given before: the page finds it in localStorage
        context.add_init_script(f"localStorage.setItem({json.dumps(KEY_STORAGE)}, {json.dumps(key)})")
    return context


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = _context(browser, KEY)
    yield context
    context.close()


@pytest.fixture
def page(context: BrowserContext, page_server: ServerProcess) -> Iterator[Page]:
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    open_page(page, page_server.base_url)
    yield page
    assert not errors, errors  # no script error on the way


class Requests:
    """The chat requests the page sends, their bodies as the server receives them."""

    def __init__(self, page: Page) -> None:
        self.bodies: list[dict[str, Any]] = []
        page.on("request", self._seen)

    def _seen(self, request: Any) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            self.bodies.append(request.post_data_json)

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


def messages(page: Page) -> list[tuple[str, ...]]:
    """The open conversation as shown: (role, text) per message."""
    return [tuple(m) for m in page.eval_on_selector_all(
        "#messages .message", "ms => ms.map(m => [m.classList.contains('user') ? 'user' : 'assistant', "
                              "m.querySelector('.content').innerText.trim()])")]


def stored_messages(page: Page) -> list[dict[str, Any]]:
    """The open conversation's messages as the page keeps them in localStorage."""
    return page.evaluate("""() => {
        const all = JSON.parse(localStorage.getItem('emberserve.chat.conversations'));
        const id = JSON.parse(localStorage.getItem('emberserve.chat.current'));
        return all.find(c => c.id === id).messages;
    }""")


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text  # /metrics needs no key
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def wait_metric(base_url: str, name: str, want: Any, page: Page) -> float:
    for _ in range(200):
        value = metric(base_url, name)
        if want(value):
            return value
        page.wait_for_timeout(50)
    raise AssertionError(f"{name} stayed {value}")


def canned_stream(route: Route, pieces: list[str], usage: dict[str, int] | None = None,
                  thoughts: list[str] = ()) -> None:
    """Answer a chat request with an event stream of `thoughts` as its reasoning deltas, then `pieces` as its
    content deltas, as the server writes one."""
    chunks = [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "delta": {"reasoning": t, "reasoning_content": t}, "finish_reason": None}]}
              for t in thoughts]
    chunks += [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if usage:
        chunks.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [],
                       "usage": {**usage, "total_tokens": sum(usage.values())}})
    body = "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks) + "data: [DONE]\r\n\r\n"
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


# ---- tests ---------------------------------------------------------------------------------------------------------

def test_the_key_is_asked_for_once_kept_and_asked_again_when_wrong(browser: Browser, page_server: ServerProcess,
                                                                     api: httpx.Client) -> None:
    """No key stored: the page itself loads (a navigation sends no key), its API calls' 401 asks for the key with
    the server's message; a wrong one is refused with the server's message and asked again; the right one is kept
    across a reload, and every API call sends it."""
    context = _context(browser, None)
    try:
        page = context.new_page()
        page.goto(page_server.base_url + "/")
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible")
        assert "didn't provide an API key" in page.inner_text("#key-error")
        page.fill("#key-input", "wrong-key")
        page.press("#key-input", "Enter")
        page.wait_for_function("() => document.getElementById('key-error').innerText.includes('Incorrect API key')")
        assert dialog.is_visible()
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        page.wait_for_selector("body.ready")
        assert not dialog.is_visible()
        assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == \
            [m["id"] for m in api.get("/v1/models").json()["data"]]
        assert page.evaluate(f"localStorage.getItem({json.dumps(KEY_STORAGE)})") == KEY
        sent: list[str | None] = []
        page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/v1/" in r.url else None)
        page.reload()
        page.wait_for_selector("body.ready")
        assert not dialog.is_visible() and sent and set(sent) == {f"Bearer {KEY}"}
    finally:
        context.close()


def test_an_answer_streams_in_pieces_with_its_figures(page: Page, api: httpx.Client) -> None:
    """Enter sends; the answer grows in the page several times before it ends; the request is a stream asking for
    usage with the page's own max_tokens; the figures shown are the server's counts."""
    requests = Requests(page)
    page.fill("#max-tokens", "32")
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const busy = document.querySelector('[aria-busy=true] .content');
            if (busy) window.lengths.push(busy.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "Count from one to twenty, separated by commas.")
    wait_answered(page)
    grown = sorted(set(n for n in page.evaluate("window.lengths") if n > 0))
    assert len(grown) >= 3, grown  # seen at three lengths at least while it streamed
    body = requests.last
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32 and body["model"] == MODEL and "preset" not in body
    assert body["messages"] == [{"role": "user", "content": "Count from one to twenty, separated by commas."}]
    shown = messages(page)
    assert shown[0] == ("user", "Count from one to twenty, separated by commas.") and shown[1][1], shown
    stats = page.inner_text(".message.assistant .stats")
    figures = re.search(r"([\d.]+) tok/s · first token (\d+) ms · (\d+) prompt \+ (\d+) completion tokens", stats)
    assert figures, stats
    prompt_tokens = api.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
    assert int(figures.group(3)) == prompt_tokens
    assert 0 < int(figures.group(4)) <= 32 and float(figures.group(1)) > 0
    assert page.get_attribute("#messages", "aria-live") == "polite"  # the streamed answer is a live region


def test_stop_ends_the_request_on_the_server(page: Page, page_server: ServerProcess) -> None:
    """Stop (the button, then Esc on a regenerated answer) aborts the request: the server counts an abort and its
    running-requests gauge goes back to 0; the partial answer stays, marked stopped."""
    base = page_server.base_url
    page.fill("#max-tokens", "2000")
    for stop in ("button", "escape"):
        aborted = metric(base, ABORTED)
        if stop == "button":
            send(page, "Write a very long story about a dragon who learns to bake bread.")
        else:
            page.click(".regenerate")
        page.wait_for_function("() => document.querySelector('[aria-busy=true] .content')?.textContent.length > 0",
                               timeout=ANSWER_TIMEOUT_MS)
        assert wait_metric(base, RUNNING, lambda v: v >= 1, page) >= 1
        if stop == "button":
            page.click("#stop")
        else:
            page.keyboard.press("Escape")
        wait_answered(page)
        assert wait_metric(base, RUNNING, lambda v: v == 0, page) == 0
        assert wait_metric(base, ABORTED, lambda v: v == aborted + 1, page) == aborted + 1
        assert "stopped" in page.inner_text(".message.assistant .stats")
        assert messages(page)[-1][1]  # what came before the stop stays


def test_presets_are_offered_and_sent(page: Page, api: httpx.Client) -> None:
    """The picker lists the server's presets; a chosen one travels as `preset` (with the sampling fields it fills
    left out) and fills the page's max tokens; the server applies it: precise is greedy."""
    requests = Requests(page)
    presets = api.get("/v1/presets").json()["data"]
    assert page.eval_on_selector_all("#preset option", "os => os.map(o => o.value)")[1:] == [p["name"] for p in presets]
    precise = next(p for p in presets if p["name"] == "precise")
    page.select_option("#preset", "precise")
    assert page.input_value("#max-tokens") == str(precise["max_tokens"])
    assert page.get_attribute("#temperature", "placeholder").startswith(f"{precise['temperature']:g}")
    page.fill("#max-tokens", "12")
    send(page, "Name a colour.")
    wait_answered(page)
    body = requests.last
    assert body["preset"] == "precise" and body["max_tokens"] == 12
    assert "temperature" not in body and "top_p" not in body
    greedy = api.post("/v1/chat/completions", json={"model": MODEL, "messages": body["messages"], "max_tokens": 12,
                                                    "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert stored_messages(page)[-1]["content"] == greedy
    page.select_option("#preset", "fast")
    page.fill("#temperature", "0.3")
    page.click(".regenerate")
    wait_answered(page)
    assert requests.last["preset"] == "fast" and requests.last["temperature"] == 0.3


def test_regenerate_and_edit_resend(page: Page) -> None:
    """Regenerate asks again with the same messages in place of the last answer; editing a user message resends it
    and drops everything after it."""
    requests = Requests(page)
    page.fill("#max-tokens", "8")
    send(page, "Say hello.")
    wait_answered(page)
    send(page, "Now say goodbye.")
    wait_answered(page)
    assert len(messages(page)) == 4
    page.click(".regenerate")
    wait_answered(page)
    assert requests.bodies[-1]["messages"] == requests.bodies[-2]["messages"]
    assert len(messages(page)) == 4
    page.click(".message.user >> nth=0 >> text=Edit")
    page.fill("textarea.edit", "Say thanks.")
    page.press("textarea.edit", "Enter")
    wait_answered(page)
    assert requests.last["messages"] == [{"role": "user", "content": "Say thanks."}]
    shown = messages(page)
    assert [role for role, _ in shown] == ["user", "assistant"] and shown[0][1] == "Say thanks."


def test_conversations_are_kept_listed_renamed_exported_and_deleted(page: Page, page_server: ServerProcess) -> None:
    """Conversations live in localStorage: a reload shows the same list and messages; new, rename, export (a JSON
    download of the messages) and delete work from the list."""
    page.fill("#max-tokens", "8")
    page.fill("#system", "You are terse.")
    send(page, "First chat.")
    wait_answered(page)
    page.click("#new-chat")
    send(page, "Second chat.")
    wait_answered(page)
    before = messages(page)
    page.reload()
    page.wait_for_selector("body.ready")
    titles = page.eval_on_selector_all("#conversations .open", "bs => bs.map(b => b.innerText)")
    assert titles == ["Second chat.", "First chat."] and messages(page) == before
    assert page.input_value("#system") == "You are terse."
    page.click("#conversations li >> nth=1 >> button.open")
    assert messages(page)[0] == ("user", "First chat.")
    page.click("#conversations li.current >> [aria-label^=Rename]")
    page.fill("#conversations input.rename", "Renamed")
    page.press("#conversations input.rename", "Enter")
    assert page.inner_text("#conversation-title") == "Renamed"
    with page.expect_download() as download:
        page.click("#conversations li.current >> [aria-label^=Export]")
    exported = json.loads(Path(download.value.path()).read_text())["conversation"]
    assert exported["title"] == "Renamed" and exported["system"] == "You are terse."
    assert [(m["role"], m["content"].strip()) for m in exported["messages"]][0] == ("user", "First chat.")
    assert len(exported["messages"]) == 2 and "stats" in exported["messages"][1]
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#conversations li.current >> [aria-label^=Delete]")
    assert page.eval_on_selector_all("#conversations .open", "bs => bs.map(b => b.innerText)") == ["Second chat."]
    page.reload()
    page.wait_for_selector("body.ready")
    assert page.eval_on_selector_all("#conversations .open", "bs => bs.map(b => b.innerText)") == ["Second chat."]


def test_model_output_renders_as_markdown_and_never_as_html(page: Page) -> None:
    """Markdown becomes HTML; HTML the model writes (split across chunks, too) shows as text; nothing of it runs,
    and a javascript: link loses its target."""
    pieces = ["Some **bold** and `code`.\n\n- one\n- two\n\n<scr", "ipt>window.pwned = 1</script>\n\n",
              '<img src=x onerror="window.pwned = 2"> and <b onclick="window.pwned = 3">b</b>\n\n',
              "[link](javascript:window.pwned=4) [ok](https://example.com)"]
    page.route("**/v1/chat/completions", lambda route: canned_stream(route, pieces))
    send(page, "Show me HTML.")
    wait_answered(page)
    answer = page.locator(".message.assistant .content")
    assert answer.locator("strong").inner_text() == "bold" and answer.locator("code").inner_text() == "code"
    assert answer.locator("li").all_inner_texts() == ["one", "two"]
    text = answer.inner_text()
    assert "<script>window.pwned = 1</script>" in text and '<img src=x onerror="window.pwned = 2">' in text
    assert page.eval_on_selector_all("#messages script, #messages img, #messages [onclick], #messages [onerror]",
                                     "es => es.length") == 0
    hrefs = answer.locator("a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
    assert hrefs == [None, "https://example.com"], hrefs
    assert page.evaluate("window.pwned") is None


def test_a_reasoning_models_thinking_is_folded_apart_from_the_answer_as_text(page: Page) -> None:
    thoughts = ["The user asks **2+2**.", " <script>window.pwned = 5</script>", "\nIt is 4."]
    page.route("**/v1/chat/completions", lambda route: canned_stream(route, ["It is **4**."], thoughts=thoughts))
    send(page, "What is 2+2?")
    wait_answered(page)
    thinking = page.locator(".message.assistant details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # folded
    thinking.locator("summary").click()
    assert thinking.locator(".thinking-text").inner_text() == "".join(thoughts)  # plain text, markup and all
    assert page.locator(".message.assistant .content strong").inner_text() == "4"
    assert page.eval_on_selector_all("#messages script", "es => es.length") == 0
    assert page.evaluate("window.pwned") is None
    page.reload()
    page.wait_for_selector("body.ready")
    assert page.locator(".message.assistant .thinking-text").text_content() == "".join(thoughts)  # kept


def test_api_errors_show_the_envelopes_message(page: Page, api: httpx.Client) -> None:
    """A request the server refuses shows its error.message; so does an error event in the middle of a stream."""
    page.fill("#temperature", "5")
    send(page, "Hello?")
    wait_answered(page)
    refused = api.post("/v1/chat/completions", json={"model": MODEL, "temperature": 5, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "Hello?"}]})
    assert refused.status_code == 400
    assert page.inner_text(".message.assistant .message-error") == f"Error: {refused.json()['error']['message']}"

    def failing(route: Route) -> None:
        body = ('data: {"choices": [{"index": 0, "delta": {"content": "Half"}}]}\n\n'
                'data: {"error": {"message": "the worker failed", "type": "server_error", "param": null, '
                '"code": null}}\n\n')
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    page.route("**/v1/chat/completions", failing)
    page.click(".regenerate")
    wait_answered(page)
    assert page.inner_text(".message.assistant .message-error") == "Error: the worker failed"
    assert messages(page)[-1][1] == "Half"


def test_themes_labels_and_a_phones_width(browser: Browser, page_server: ServerProcess,
                                           tmp_path: Path) -> None:
    """The system's dark preference and the toggle choose the theme; every control has an accessible name; at a
    phone's width nothing scrolls sideways, long code included, with the panels open or shut."""
    context = _context(browser, KEY, color_scheme="dark", viewport={"width": 390, "height": 844})
    try:
        page = context.new_page()
        open_page(page, page_server.base_url)
        background = "getComputedStyle(document.body).backgroundColor"
        dark = page.evaluate(background)
        page.click("#toggle-theme")  # automatic -> light
        assert page.get_attribute("html", "data-theme") == "light" and page.evaluate(background) != dark
        page.click("#toggle-theme")  # light -> dark
        assert page.evaluate(background) == dark
        unnamed = page.evaluate("""() => [...document.querySelectorAll('button, input, select, textarea')]
            .filter(e => !(e.labels?.length || e.getAttribute('aria-label') || e.innerText.trim()))
            .map(e => e.outerHTML)""")
        assert not unnamed, unnamed
        long_line = "x = [" + ", ".join(str(i) for i in range(200)) + "]"
        page.route("**/v1/chat/completions",
                   lambda route: canned_stream(route, [f"```python\n{long_line}\n```\n", "a" * 300],
                                               usage={"prompt_tokens": 5, "completion_tokens": 7}))
        send(page, "A long line, please.")
        wait_answered(page)
        overflow = "document.documentElement.scrollWidth <= innerWidth && document.body.scrollWidth <= innerWidth"
        assert page.evaluate(overflow)
        page.screenshot(path=str(tmp_path / "phone.png"))
        for panel in ("#toggle-sidebar", "#toggle-settings"):
            page.click(panel)
            assert page.evaluate(overflow), panel
    finally:
        context.close()
