"""Screenshots of the chat page for docs/web/ (light and dark, desktop and phone width), taken with
Playwright over Debian's Chromium against a live server on the tiny model. The conversation shown is
stored through the API (the random-weight model talks nonsense); the last answer is the model's own.

    PYTHONPATH=. .venv/bin/python scripts/web_screenshots.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.model.builtin import make_model
from llmserve.platform.conversations import ConversationStore
from llmserve.server.app import build_app
from llmserve.server.gateway import Platform
from llmserve.store.db import open_database
from tests.server.conftest import start_server

OUT = Path(__file__).resolve().parent.parent / "docs" / "web"
ANSWER = """Here is a function that counts words, ignoring case:

```python
from collections import Counter

def word_counts(text: str) -> Counter:
    # split on whitespace, compare words case-insensitively
    return Counter(word.lower() for word in text.split())
```

- `Counter` keeps the counts; `most_common(3)` gives the top three.
- For punctuation, strip it first with **`str.translate`**.

See the [collections docs](https://docs.python.org/3/library/collections.html)."""


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = make_model(Path(scratch) / "model", "llama", "tiny", 0)
        engine = AsyncLLM.from_config(EngineConfig(model=str(model), dtype="float32", max_model_len=512))
        database = open_database(f"sqlite:///{scratch}/platform.db")
        app = build_app(engine, "tiny-llama", platform=Platform(conversations=ConversationStore(database)))
        server, thread, base_url, _ = start_server(app)
        try:
            for title in ("Trip to Lisbon", "Birthday ideas"):
                httpx.post(f"{base_url}/v1/conversations", json={"title": title})
            shown = httpx.post(f"{base_url}/v1/conversations", json={"title": "Counting words in Python", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "How do I count words in a text?"},
                {"role": "assistant", "content": ANSWER},
            ]}).json()["id"]
            shoot(base_url, shown)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            engine.close()


def shoot(base_url: str, conversation_id: str) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for theme in ("light", "dark"):
            for name, viewport in (("", {"width": 1280, "height": 800}), ("-phone", {"width": 390, "height": 844})):
                context = browser.new_context(base_url=base_url, viewport=viewport, color_scheme=theme)
                page = context.new_page()
                page.goto(f"/#{conversation_id}")
                page.wait_for_selector(".msg.assistant .code")
                page.fill("#prompt", "And in one line?")
                page.screenshot(path=str(OUT / f"chat-{theme}{name}.png"))
                context.close()
        browser.close()


if __name__ == "__main__":
    main()
