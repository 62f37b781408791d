"""The chat page in a real browser (Debian's Chromium driven by Playwright) against a live server over
the tiny model: streaming, stop, branches, reload, delete, untrusted output rendered inert, a dropped
connection resumed, and the key errors. Skips only where Chromium is not installed."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.content_routing import ContentRouterConfig
from llmserve.server.app import ModelSpec
from tests.server.conftest import tiny_engine_running
from tests.server.platform_fixtures import PlatformServer, serve_platform

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"the browser tests need Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip install playwright)")

MAX_MODEL_LEN = 2048  # room for an answer long enough to stop in the middle
TIMEOUT_MS = 30_000

ATTACK = (
    'Look: <img src=x onerror="window.__pwned = 1"> and <script>window.__pwned = 2</script> '
    "[click me](javascript:window.__pwned=3) <a href=\"javascript:window.__pwned=4\">raw link</a> "
    "[a real link](https://example.com/docs)\n\n```html\n<script>window.__pwned = 5</script>\n```"
)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncLLM]:
    with tiny_engine_running(tiny_llama_dir, num_kv_blocks=1024, max_num_batched_tokens=256,
                             max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


@pytest.fixture
def server(engine: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:
    yield from serve_platform(engine, tmp_path)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server: PlatformServer) -> Iterator[object]:
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    yield page
    context.close()


@contextmanager
def page_on(browser, server: PlatformServer) -> Iterator[tuple[object, list[str]]]:
    """A page on a server of the test's own, and the errors its scripts raise."""
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield page, errors
    finally:
        context.close()


def open_page(page, settings: dict[str, str] | None = None, path: str = "/") -> None:
    page.goto(path)
    page.wait_for_selector("#model option", state="attached")
    if settings:
        page.click(".settings summary")
        for field, value in settings.items():
            page.fill(f"#{field}", value)


def send(page, text: str) -> None:
    """Type `text` and press Enter, then wait for the answer to end."""
    with answer_ends(page):
        page.fill("#prompt", text)
        page.press("#prompt", "Enter")


@contextmanager
def answer_ends(page) -> Iterator[None]:
    """Wait, after the block, for the page to finish one more answer (done, stopped or failed)."""
    before = page.evaluate("() => Number(document.body.dataset.answers ?? 0)")
    yield
    page.wait_for_function(f"() => Number(document.body.dataset.answers ?? 0) > {before}")


def answers(page) -> list[str]:
    return page.locator(".msg.assistant .body").all_inner_texts()


def metric(server: PlatformServer, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if re.match(rf"{re.escape(name)}(\{{| )", line))


def ignoring_eos(route) -> None:
    """The page's chat request with ignore_eos: an answer that surely runs to max_tokens."""
    body = json.loads(route.request.post_data)
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


def test_stream_stop_regenerate_branches_reload_and_delete(page, server: PlatformServer):
    open_page(page, {"max-tokens": str(MAX_MODEL_LEN - 100)})
    page.route("**/v1/chat/completions", ignoring_eos)
    aborted_before = metric(server, "llmserve:requests_aborted_total")
    with answer_ends(page):
        page.fill("#prompt", "Write a long story")
        page.press("#prompt", "Enter")
        # Tokens show while the answer is still streaming.
        page.wait_for_function("() => document.querySelector('.msg.assistant.streaming .body')?.textContent.length > 0")
        page.keyboard.press("Escape")  # Esc stops: the stream is deleted on the server, its KV freed
    assert "stopped" in page.inner_text(".msg.assistant .meta")
    stats = server.idle_stats()
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    assert metric(server, "llmserve:requests_aborted_total") == aborted_before + 1
    assert metric(server, "vllm:num_requests_running") == 0

    page.unroute("**/v1/chat/completions")
    page.fill("#max-tokens", "12")
    send(page, "Hello there")
    assert "12 tokens" in page.inner_text(".msg.assistant:last-child .meta")
    first_reply = page.get_attribute(".msg.assistant:last-child", "data-id")
    with answer_ends(page):
        page.click(".msg.assistant:last-child button.regenerate")
    assert page.inner_text(".msg.assistant:last-child .branch-label") == "2/2"
    second_reply = page.get_attribute(".msg.assistant:last-child", "data-id")
    page.click(".msg.assistant:last-child .branches .prev")
    assert page.inner_text(".msg.assistant:last-child .branch-label") == "1/2"
    assert page.get_attribute(".msg.assistant:last-child", "data-id") == first_reply != second_reply

    page.reload()  # the conversation is stored: the address names it, the branches are back
    page.wait_for_selector(".msg.assistant .branch-label")
    assert page.inner_text(".msg.assistant:last-child .branch-label") == "2/2"
    assert page.locator("#conversations li").count() == 1
    conversation_id = page.get_attribute("#conversations li", "data-id")
    page.click("#conversations li .delete")
    page.wait_for_selector("#conversations li", state="detached")
    assert httpx.get(f"{server.base_url}/v1/conversations/{conversation_id}").status_code == 404
    assert page.errors == [] and page.dialogs == []


def test_phone_width_themes_keyboard_system_prompt_and_rename(page, server: PlatformServer):
    page.set_viewport_size({"width": 390, "height": 844})
    open_page(page, {"system-prompt": "Answer in one word.", "max-tokens": "4"})
    assert not page.is_visible("#new-chat")  # the conversation list folds away at phone width
    page.click("#theme")
    assert page.get_attribute("html", "data-theme") == "dark"
    page.fill("#prompt", "line one")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    page.type("#prompt", "line two")
    assert page.input_value("#prompt") == "line one\nline two" and answers(page) == []
    with answer_ends(page):
        page.press("#prompt", "Enter")
    assert page.input_value("#prompt") == "" and len(answers(page)) == 1

    page.click("#menu")
    conversation_id = page.get_attribute("#conversations li", "data-id")
    page.click("#conversations li .rename")
    page.fill(".rename-input", "One word")
    page.press(".rename-input", "Enter")
    page.wait_for_selector("#conversations li .open:text('One word')")
    stored = httpx.get(f"{server.base_url}/v1/conversations/{conversation_id}/tree").json()["data"]
    assert [(m["role"], m["content"]) for m in stored[:2]] == [("system", "Answer in one word."), ("user", "line one\nline two")]
    assert httpx.get(f"{server.base_url}/v1/conversations/{conversation_id}").json()["title"] == "One word"
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.get_attribute("html", "data-theme") == "dark"  # the theme is remembered
    assert page.input_value("#system-prompt") == "Answer in one word." and page.is_disabled("#system-prompt")
    assert page.errors == []


def test_a_conversation_with_tool_calls_shows_them_and_goes_on(page, server: PlatformServer):
    """Kept by an API client: its calls show as name(arguments), as text, its outputs as the tool's; a new turn
    continues the conversation with them."""
    arguments = '{"html": "<img src=x onerror=\\"window.__pwned = 1\\">"}'
    items = [{"type": "message", "role": "user", "content": "What time is it?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "noon"},
             {"type": "message", "role": "assistant", "content": "It is noon."}]
    created = httpx.post(f"{server.base_url}/v1/conversations", json={"items": items}).json()
    open_page(page, path=f"/#{created['id']}")
    page.wait_for_selector(".msg.assistant .body code.tool-call")
    shown = [(view.query_selector(".role").inner_text(), view.query_selector(".body").inner_text())
             for view in page.query_selector_all("#messages .msg")]
    assert shown == [("You", "What time is it?"), ("Tool call", f"get_time({arguments})"), ("Tool output", "noon"),
                     ("Assistant", "It is noon.")]
    assert page.evaluate("() => window.__pwned") is None
    send(page, "Thanks.")
    tree = httpx.get(f"{server.base_url}/v1/conversations/{created['id']}/tree").json()["data"]
    assert [m["role"] for m in tree] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert len(answers(page)) == 3 and not page.errors


def test_model_output_is_rendered_inert(page, server: PlatformServer):
    created = httpx.post(f"{server.base_url}/v1/conversations", json={"title": "attack", "messages": [
        {"role": "user", "content": "Say something nasty"}, {"role": "assistant", "content": ATTACK},
    ]}).json()
    open_page(page, path=f"/#{created['id']}")
    body = page.wait_for_selector(".msg.assistant .body")
    assert_inert(page, body)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click(".msg.assistant footer .copy")  # the answer's own text, as the model wrote it
    page.wait_for_selector(".msg.assistant footer .copy:text('Copied')")
    assert page.evaluate("() => navigator.clipboard.readText()") == ATTACK
    assert page.query_selector(".msg.user button.edit") is None, "a turn at the root cannot branch"

    # The same text streamed (a fake server answer, on a server without a conversation store, so the
    # page keeps the chat in the tab): inert once it is done.
    page.route(re.compile(r"/v1/conversations"), lambda route: route.fulfill(status=404, json={"error": {
        "message": "Conversation storage is not enabled on this server.", "type": "invalid_request_error",
        "param": None, "code": "not_enabled"}}))
    chunks = [ATTACK[i:i + 7] for i in range(0, len(ATTACK), 7)]
    events = "".join(
        f'id: {i}\ndata: {json.dumps({"id": "chatcmpl-x", "choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]})}\n\n'
        for i, c in enumerate(chunks)
    ) + f"id: {len(chunks)}\ndata: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream", "x-stream-id": "chatcmpl-x"}, body=events,
    ))
    open_page(page)
    # the model list arrives before the conversation store's 404 does: wait for the note, not just the models
    page.wait_for_selector("#store-note", state="visible")
    send(page, "again")
    assert_inert(page, page.query_selector(".msg.assistant .body"))


def assert_inert(page, body) -> None:
    text = body.inner_text()
    assert '<img src=x onerror="window.__pwned = 1">' in text and "<script>window.__pwned = 2</script>" in text
    assert "[click me](javascript:window.__pwned=3)" in text and "<script>window.__pwned = 5</script>" in text
    assert body.query_selector_all("img, script, iframe, [onerror]") == []
    links = [a.get_attribute("href") for a in body.query_selector_all("a")]
    assert links == ["https://example.com/docs"]
    assert page.evaluate("() => window.__pwned") is None
    assert page.errors == [] and page.dialogs == []


def test_a_dropped_connection_resumes_to_the_same_answer(page, server: PlatformServer):
    open_page(page, {"temperature": "0", "max-tokens": "60"})
    send(page, "Count to ten")
    uninterrupted = answers(page)[-1]

    # The connection drops after five events: the page resumes the stream from the last id it saw.
    def drop_midway(route) -> None:
        response = route.fetch()
        events = response.text().split("\n\n")
        route.fulfill(status=200, headers=response.headers, body="\n\n".join(events[:5]) + "\n\n")

    page.route("**/v1/chat/completions", drop_midway)
    resumes = []
    page.on("request", lambda request: resumes.append(request.headers.get("last-event-id"))
            if "/v1/streams/" in request.url else None)
    page.click("#new-chat")
    send(page, "Count to ten")
    assert resumes == ["4"]
    assert answers(page)[-1] == uninterrupted and len(uninterrupted) > 0
    assert page.inner_text("#error") == ""


class CuttableProxy:
    """A TCP proxy in front of the server whose connections the test can cut, as a network that drops."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection open now (new ones still get through)."""
        with self.lock:
            cut, self.open = self.open, []
        for connection in cut:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_the_network_dropping_mid_answer_is_survived(browser, server: PlatformServer):
    proxy = CuttableProxy(server.base_url)
    context = browser.new_context(base_url=proxy.base_url)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        open_page(page, {"temperature": "0", "max-tokens": "1200"})
        page.route("**/v1/chat/completions", ignoring_eos)
        send(page, "Tell me everything")
        uninterrupted = answers(page)[-1]
        page.click("#new-chat")
        with answer_ends(page):
            page.fill("#prompt", "Tell me everything")
            page.press("#prompt", "Enter")
            page.wait_for_function("() => document.querySelector('.msg.assistant.streaming .body')?.textContent.length > 0")
            proxy.cut()
            page.wait_for_selector("#connection:not([hidden])")  # "reconnecting", then resumed
        assert answers(page)[-1] == uninterrupted and len(uninterrupted) > 1000
        assert page.inner_text("#error") == ""
    finally:
        context.close()
        proxy.close()


def test_a_wrong_key_shows_the_401_message_and_limits_show_when_to_retry(page, server: PlatformServer):
    server.new_key("the only key")
    server.clock.advance(10)  # past the key cache's memory of "no keys yet"
    open_page_without_models(page)
    page.fill("#api-key", "sk-wrong")
    page.press("#api-key", "Enter")
    page.locator("#api-key").blur()
    page.wait_for_selector("#error:not([hidden])")
    assert "401" in page.inner_text("#error") and "API key" in page.inner_text("#error")
    assert page.evaluate("() => localStorage.getItem('llmserve.apiKey')") == "sk-wrong"

    for status, retry_after, expected in ((429, "7", "Try again in 7 s"), (503, "3", "Retry in 3 s")):
        page.route("**/v1/models", refusal(status, retry_after))
        page.reload()
        page.wait_for_selector("#error:not([hidden])")
        assert str(status) in page.inner_text("#error") and expected in page.inner_text("#error")
        page.unroute("**/v1/models")


def test_a_spent_quota_says_so_and_when_it_renews(page, server: PlatformServer):
    _, secret = server.new_key("metered", token_quota=1, quota_period="day")
    server.clock.advance(10)  # past the key cache's memory of "no keys yet"
    open_page_without_models(page)
    page.fill("#api-key", secret)
    page.press("#api-key", "Enter")
    page.wait_for_selector("#model option", state="attached")
    send(page, "Hello")  # the first request starts under the quota, and spends it
    send(page, "Hello again")
    page.wait_for_selector("#error:not([hidden])")
    error = page.inner_text("#error")
    assert error.startswith("429 Quota used up: You exceeded your token quota of 1 tokens per day")
    assert "it renews at " in error and "rate limit" not in error


def refusal(status: int, retry_after: str):
    """A route handler answering `status` with Retry-After, as the server does when it refuses."""
    def fulfill(route) -> None:
        route.fulfill(status=status, headers={"retry-after": retry_after}, json={
            "error": {"message": "not now", "type": "rate_limit_error", "param": None, "code": None}})
    return fulfill


def open_page_without_models(page) -> None:
    page.goto("/")
    page.wait_for_selector("#error:not([hidden])")  # no key yet: the model list is refused


@pytest.fixture
def routed_server(engine: AsyncLLM, minilm_engine: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:
    """`auto` routes greetings to `small`, proofs to `big` (the tiny model under both names) by all-MiniLM-L6-v2."""
    models = [ModelSpec("small", engine=engine), ModelSpec("big", engine=engine), ModelSpec("minilm", engine=minilm_engine)]
    auto = ContentRouterConfig(embedding_model="minilm", default="big", top_k=1,
                               routes={"small": ["hi there, how are you?"], "big": ["Prove that 2 is irrational."]})
    yield from serve_platform(engine, tmp_path, models=models, content_routers={"auto": auto})


def test_an_answer_a_router_sent_on_names_the_model_that_ran(browser, routed_server: PlatformServer):
    with page_on(browser, routed_server) as (page, errors):
        open_page(page, {"max-tokens": "4"})
        page.select_option("#model", "auto")
        send(page, "hello, how are you doing?")
        assert "answered by small" in page.locator(".msg.assistant .meta").last.inner_text()
        page.select_option("#model", "small")
        send(page, "hello again")
        assert "answered by" not in page.locator(".msg.assistant .meta").last.inner_text()  # the model it asked for
        assert errors == []


@pytest.fixture(scope="module")
def llava_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLM]:
    from llmserve.model.builtin_llava import make_llava

    model_dir = make_llava(tmp_path_factory.mktemp("llava-web") / "model", "tiny")
    with tiny_engine_running(model_dir, num_kv_blocks=1024, max_num_batched_tokens=256,
                             max_model_len=MAX_MODEL_LEN) as engine:
        yield engine


def png_files(directory: Path, count: int) -> list[str]:
    from tests.engine.test_vision import random_image

    paths = []
    for seed in range(count):
        path = directory / f"image-{seed}.png"
        random_image(seed).save(path)
        paths.append(str(path))
    return paths


def test_images_attached_to_a_message_are_sent_shown_and_sent_again_on_regenerate(browser, llava_engine, tmp_path):
    with contextlib.contextmanager(serve_platform)(llava_engine, tmp_path) as server, \
            page_on(browser, server) as (page, errors):
        bodies: list[dict] = []

        def record(route) -> None:
            bodies.append(json.loads(route.request.post_data))
            route.continue_()

        open_page(page, {"max-tokens": "8"})
        page.route("**/v1/chat/completions", record)
        page.set_input_files("#image-file", png_files(tmp_path, 2))
        page.wait_for_function("() => document.querySelectorAll('#attachments .thumb').length === 2")
        page.click("#attachments .attachment:first-child .remove-image")  # one of them taken off again
        assert page.locator("#attachments .thumb").count() == 1
        send(page, "What is in it?")
        parts = bodies[-1]["messages"][-1]["content"]
        assert [part["type"] for part in parts] == ["image_url", "text"] and parts[1]["text"] == "What is in it?"
        assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
        assert page.locator(".msg.user .images .thumb").count() == 1 and page.locator("#attachments").is_hidden()
        assert answers(page)[-1] and page.locator(".msg .notice").count() == 0
        with answer_ends(page):
            page.click(".msg.assistant:last-child button.regenerate")
        assert bodies[-1]["messages"][-1]["content"] == parts  # the image goes again with the regenerated turn
        assert page.inner_text(".msg.assistant:last-child .branch-label") == "2/2"
        assert page.locator(".msg.user .images .thumb").count() == 1
        send(page, "And the colours?")  # the stored conversation sends its image to the model again, not the page
        assert bodies[-1]["messages"] == [{"role": "user", "content": "And the colours?"}]
        assert answers(page)[-1] and page.locator(".msg .notice").count() == 0
        page.reload()  # the server stored the image with its turn
        page.wait_for_selector(".msg.user .images .thumb")
        assert page.locator(".msg.user .images .thumb").count() == 1
        assert page.get_attribute(".msg.user .images .thumb", "src") == parts[0]["image_url"]["url"]
        assert errors == []


def test_an_image_for_a_model_that_reads_none_shows_the_servers_message(page, server: PlatformServer, tmp_path):
    open_page(page)
    page.set_input_files("#image-file", png_files(tmp_path, 1))
    page.wait_for_selector("#attachments .thumb")
    send(page, "What is in it?")
    page.wait_for_selector("#error:not([hidden])")
    assert "reads text only" in page.inner_text("#error")


def test_a_reasoning_models_thought_folds_above_its_answer_and_is_not_sent_again(browser, tiny_qwen3_dir, tmp_path):
    """Served with --reasoning-parser qwen3: the streamed reasoning shows folded above the answer, as plain text;
    the stored turn (reasoning, then answer) reads back as that one reply, and regenerating it asks the user's
    question again."""
    with (
        tiny_engine_running(tiny_qwen3_dir, num_kv_blocks=256, max_num_batched_tokens=256) as engine,
        contextlib.contextmanager(serve_platform)(
            engine, tmp_path, models=[ModelSpec("tiny", engine=engine, root=str(tiny_qwen3_dir),
                                                reasoning_parser="qwen3")]) as server,
        page_on(browser, server) as (page, errors),
    ):
        bodies: list[dict] = []

        def thinking(route) -> None:
            """With thinking off the constraint applies from the first token, so the regex writes a thought."""
            body = {**json.loads(route.request.post_data), "guided_regex": "<think>[a-z <>]{2,12}</think>[a-z]{2,6}",
                    "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0}
            bodies.append(body)
            route.continue_(post_data=json.dumps(body))

        open_page(page, {"max-tokens": "40"})
        page.route("**/v1/chat/completions", thinking)
        send(page, "What is the weather?")
        thought = page.text_content(".msg.assistant .thought-text")
        answer = page.inner_text(".msg.assistant .body > p")
        assert re.fullmatch("[a-z <>]{2,12}", thought) and re.fullmatch("[a-z]{2,6}", answer)
        assert page.get_attribute(".msg.assistant .thought", "open") is None  # folded
        assert page.inner_text(".msg.assistant .thought summary") == "Reasoning"
        assert page.locator(".msg.assistant .thought-text *").count() == 0  # "<" and ">" in it are text
        with answer_ends(page):
            page.click(".msg.assistant:last-child button.regenerate")
        assert bodies[-1]["messages"] == [{"role": "user", "content": "What is the weather?"}]
        assert page.inner_text(".msg.assistant:last-child .branch-label") == "2/2"

        page.reload()
        page.wait_for_selector(".msg.assistant .thought")
        shown = [view.query_selector(".role").inner_text() for view in page.query_selector_all("#messages .msg")]
        assert shown == ["System", "You", "Assistant"]
        assert page.inner_text(".msg.assistant:last-child .branch-label") == "2/2"
        page.click(".msg.assistant:last-child .branches .prev")
        assert page.text_content(".msg.assistant .thought-text") == thought
        assert page.inner_text(".msg.assistant .body > p") == answer
        assert errors == []
