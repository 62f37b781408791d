"""/v1/conversations over HTTP: the limits on what a conversation holds (413), its messages a page at
a time, 400s for bad cursors (SQLite and PostgreSQL), a long conversation fitted into the context
window by `truncation: "auto"`, and OpenAI's Conversations API (items, metadata) through the `openai` SDK."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.cli import build_parser
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.conversations import ConversationLimits, ConversationStore
from llmserve.server.app import ModelSpec
from llmserve.server.conversations import TRUNCATED_HEADER, ItemPage, fit_history
from llmserve.server.platform_options import conversation_limits
from llmserve.store.db import open_database
from tests.server.conftest import MAX_MODEL_LEN, tiny_engine_running
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
    sse_events,
    tiny_engine,  # noqa: F401 - a fixture
)
from tests.store.fixtures import BACKENDS, postgres_schema, postgres_url


@pytest.fixture(params=MODES)
def server(request: pytest.FixtureRequest, tiny_engine: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:  # noqa: F811
    """The platform in `llmserve serve` or in `llmserve gateway`."""
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


@pytest.fixture(params=BACKENDS)
def any_backend_server(request: pytest.FixtureRequest, server: PlatformServer) -> Iterator[PlatformServer]:
    """The server, its conversations on SQLite or on PostgreSQL."""
    if request.param == "sqlite":
        yield server
        return
    with postgres_schema() as schema:
        database = open_database(postgres_url(schema))
        server.platform.conversations = ConversationStore(database)
        try:
            yield server
        finally:
            database.dispose()


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def turns(*contents: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content} for content in contents]


# ---- limits ---------------------------------------------------------------------------------------


def test_limits_on_messages_are_413s_before_any_engine_work(server: PlatformServer) -> None:
    server.platform.conversations = ConversationStore(
        server.database, ConversationLimits(max_message_bytes=64, max_messages_per_request=3, max_messages=6)
    )
    with server.client() as client:
        too_many = client.post("/v1/conversations", json={"messages": turns("a", "b", "c", "d")})
        too_large = client.post("/v1/conversations", json={"messages": turns("fine", "é" * 33)})  # 66 bytes
        assert client.get("/v1/conversations").json()["data"] == []  # neither was stored
        created = client.post("/v1/conversations", json={"messages": turns("a", "b", "c")})
        conversation_id = created.json()["id"]
        turn = client.post("/v1/chat/completions", json=chat_body("d", conversation_id=conversation_id))
        big_turn = client.post("/v1/chat/completions", json=chat_body("x" * 65, conversation_id=conversation_id))
        full = client.post("/v1/chat/completions", json=chat_body("f", conversation_id=conversation_id))
        summary = client.get(f"/v1/conversations/{conversation_id}").json()
    assert too_many.status_code == 413
    assert error_of(too_many) == {
        "message": "At most 3 messages can be added at once; got 4.", "type": "invalid_request_error",
        "param": "messages", "code": "too_many_messages",
    }
    assert too_large.status_code == 413 and error_of(too_large)["param"] == "messages[1].content"
    assert error_of(too_large)["code"] == "message_too_large"
    assert created.status_code == 201 and created.json()["message_count"] == 3
    assert turn.status_code == 200 and turn.headers[TRUNCATED_HEADER] == "0"
    assert big_turn.status_code == 413 and error_of(big_turn)["param"] == "messages[0].content"
    # 5 stored; this turn's message and reply would make 7.
    assert full.status_code == 413 and error_of(full)["code"] == "conversation_too_long"
    assert summary["message_count"] == 5
    assert len(server.wait_for_usage_rows(1)) == 1  # only the one turn that ran was metered


def test_serve_flags_set_theconversation_limits() -> None:
    parser = build_parser()
    assert conversation_limits(parser.parse_args(["serve"])) == ConversationLimits()
    args = parser.parse_args(["serve", "--conversation-max-message-bytes", "4096", "--conversation-max-messages", "50"])
    assert conversation_limits(args) == ConversationLimits(max_message_bytes=4096, max_messages=50)


# ---- the chat page's needs: every branch at once, renaming -------------------------------------------


def test_the_tree_holds_every_branch_and_the_head_marks_the_active_one(server: PlatformServer) -> None:
    owner, other = server.new_key("owner")[1], server.new_key("another")[1]
    with server.client(owner) as client, server.client(other) as stranger:
        conversation = client.post("/v1/conversations", json={"messages": [{"role": "system", "content": "Be brief"}]})
        conversation_id = conversation.json()["id"]
        system_id = client.get(f"/v1/conversations/{conversation_id}/tree").json()["data"][0]["id"]
        first = client.post("/v1/chat/completions", json=chat_body("hi", conversation_id=conversation_id))
        again = client.post(  # regenerate: the same turn again from the same parent, a second branch
            "/v1/chat/completions", json=chat_body("hi", conversation_id=conversation_id, parent_message_id=system_id)
        )
        tree = client.get(f"/v1/conversations/{conversation_id}/tree").json()
        foreign = stranger.get(f"/v1/conversations/{conversation_id}/tree")
    assert first.status_code == again.status_code == 200
    messages = tree["data"]
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Be brief"), ("user", "hi"), ("assistant", first.json()["choices"][0]["message"]["content"]),
        ("user", "hi"), ("assistant", again.json()["choices"][0]["message"]["content"]),
    ]
    assert messages[1]["parent_id"] == messages[3]["parent_id"] == system_id
    assert messages[2]["parent_id"] == messages[1]["id"] and messages[4]["parent_id"] == messages[3]["id"]
    assert tree["head_message_id"] == messages[4]["id"] and tree["object"] == "conversation.tree"
    assert foreign.status_code == 404


def test_a_conversation_can_be_renamed(server: PlatformServer) -> None:
    with server.client() as client:
        conversation_id = client.post("/v1/conversations", json={"messages": turns("a question")}).json()["id"]
        renamed = client.post(f"/v1/conversations/{conversation_id}", json={"title": "  Plans  "})
        listed = client.get("/v1/conversations").json()["data"]
        too_long = client.post(f"/v1/conversations/{conversation_id}", json={"title": "x" * 201})
        unknown = client.post("/v1/conversations/conv_nope", json={"title": "x"})
    assert renamed.status_code == 200 and renamed.json()["title"] == "Plans"
    assert renamed.json()["message_count"] == 1
    assert [c["title"] for c in listed] == ["Plans"]
    assert too_long.status_code == 400 and unknown.status_code == 404


# ---- messages, a page at a time -------------------------------------------------------------------


def test_messages_are_listed_a_page_at_a_time_in_openai_list_shape(server: PlatformServer) -> None:
    with server.client() as client:
        conversation_id = client.post("/v1/conversations", json={"messages": turns(*"abcde")}).json()["id"]
        url = f"/v1/conversations/{conversation_id}/messages"
        first = client.get(url, params={"limit": 2}).json()
        second = client.get(url, params={"limit": 2, "after": first["last_id"]}).json()
        third = client.get(url, params={"limit": 2, "after": second["last_id"]}).json()
        back = client.get(url, params={"limit": 2, "before": third["first_id"]}).json()
        oldest_first = client.get(url, params={"order": "asc", "limit": 3}).json()
        conversation = client.get(f"/v1/conversations/{conversation_id}").json()

    def contents(page: dict) -> list[str]:
        return [m["content"] for m in page["data"]]

    assert set(first) == {"object", "data", "first_id", "last_id", "has_more"} and first["object"] == "list"
    assert (contents(first), first["has_more"]) == (["e", "d"], True)
    assert (first["first_id"], first["last_id"]) == (first["data"][0]["id"], first["data"][1]["id"])
    assert (contents(second), second["has_more"]) == (["c", "b"], True)
    assert (contents(third), third["has_more"]) == (["a"], False)
    assert (contents(back), back["has_more"]) == (["c", "b"], True)
    assert (contents(oldest_first), oldest_first["has_more"]) == (["a", "b", "c"], True)
    assert first["data"][0]["object"] == "conversation.message"
    assert "messages" not in conversation and (conversation["message_count"], conversation["total_tokens"]) == (5, 0)


def test_bad_cursors_limits_and_orders_are_400s(any_backend_server: PlatformServer) -> None:
    with any_backend_server.client() as client:
        conversation_id = client.post("/v1/conversations", json={"messages": turns("a")}).json()["id"]
        url = f"/v1/conversations/{conversation_id}/messages"
        responses = {
            "after": client.get("/v1/conversations", params={"after": "conv_unknown"}),
            "messages after": client.get(url, params={"after": "msg_unknown"}),
            "messages before": client.get(url, params={"before": "msg_unknown"}),
            "limit": client.get(url, params={"limit": 0}),
            "messages limit": client.get(url, params={"limit": 101}),
            "list limit": client.get("/v1/conversations", params={"limit": "many"}),
            "order": client.get(url, params={"order": "sideways"}),
        }
        unknown = client.get("/v1/conversations/conv_unknown/messages")
    for name, response in responses.items():
        assert response.status_code == 400, name
        assert error_of(response)["param"] == name.split()[-1], name
    assert error_of(responses["after"])["code"] == error_of(responses["messages before"])["code"] == "invalid_cursor"
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "conversation_not_found"


# ---- truncation -----------------------------------------------------------------------------------


SYSTEM = {"role": "system", "content": "You are a patient travel agent who always answers in full sentences."}


def long_history(pairs: int) -> list[dict[str, str]]:
    history = [SYSTEM]
    for i in range(pairs):
        history.append({"role": "user", "content": f"Question {i}: which mountain villages near the lake are "
                                                   "worth a visit in early autumn, and how do we get there?"})
        history.append({"role": "assistant", "content": f"Answer {i}: take the morning train along the valley, "
                                                        "then the bus up to the villages above the lake shore."})
    return history


def prompt_tokens(engine: AsyncLLM, messages: list[dict[str, str]]) -> int:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def test_truncation_auto_keeps_a_long_conversation_answering(server: PlatformServer) -> None:
    max_tokens = 8
    history = long_history(12)
    question = {"role": "user", "content": "And where should we stay?"}
    assert prompt_tokens(server.engine, [*history, question]) + max_tokens > MAX_MODEL_LEN
    with server.client() as client:
        conversation_id = client.post("/v1/conversations", json={"messages": history}).json()["id"]
        ask = chat_body(question["content"], max_tokens=max_tokens, conversation_id=conversation_id)
        refused = client.post("/v1/chat/completions", json=ask)  # truncation "disabled" by default
        answered = client.post("/v1/chat/completions", json={**ask, "truncation": "auto"})
        later = [
            client.post("/v1/chat/completions", json={**ask, "messages": turns(f"And on day {day}?"),
                                                      "truncation": "auto"})
            for day in range(3)
        ]
        stored = client.get(f"/v1/conversations/{conversation_id}").json()
    assert refused.status_code == 400 and error_of(refused)["code"] == "context_length_exceeded"
    assert answered.status_code == 200
    dropped = int(answered.headers[TRUNCATED_HEADER])
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question with its answer
    # Exactly the system prompt, the turns after the dropped ones, and the new question were sent ...
    kept = [SYSTEM, *history[1 + dropped:], question]
    assert answered.json()["usage"]["prompt_tokens"] == prompt_tokens(server.engine, kept)
    assert prompt_tokens(server.engine, kept) + max_tokens <= MAX_MODEL_LEN
    # ... and keeping one more turn would not have fitted: no more than needed was dropped.
    one_more = [SYSTEM, *history[dropped - 1:], question]
    assert prompt_tokens(server.engine, one_more) + max_tokens > MAX_MODEL_LEN
    assert [r.status_code for r in later] == [200, 200, 200]
    assert all(int(r.headers[TRUNCATED_HEADER]) >= dropped for r in later)
    assert stored["message_count"] == len(history) + 2 * 4  # truncation never deletes what is stored


def word_render(messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """A stand-in template: one token per word."""
    text = " ".join(m["content"] for m in messages)
    return text, [0] * len(text.split())


def test_fit_history_drops_the_fewest_oldest_whole_turns_and_keeps_the_system_prompt() -> None:
    history = [
        {"role": "system", "content": "s1 s2"},
        {"role": "user", "content": "u1 u1"}, {"role": "assistant", "content": "a1 a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}, {"role": "tool", "content": "t2"},
        {"role": "user", "content": "u3"}, {"role": "assistant", "content": "a3"},
    ]
    new = [{"role": "user", "content": "n"}]  # 12 words in all
    assert fit_history(word_render, history, new, 12, "auto") == ("s1 s2 u1 u1 a1 a1 u2 a2 t2 u3 a3 n", [0] * 12, 0)
    assert fit_history(word_render, history, new, 11, "auto")[::2] == ("s1 s2 u2 a2 t2 u3 a3 n", 2)
    assert fit_history(word_render, history, new, 8, "auto")[::2] == ("s1 s2 u2 a2 t2 u3 a3 n", 2)
    assert fit_history(word_render, history, new, 7, "auto")[::2] == ("s1 s2 u3 a3 n", 5)
    assert fit_history(word_render, history, new, 2, "auto")[::2] == ("s1 s2 n", 7)  # too long even so
    assert fit_history(word_render, history, new, 2, "disabled")[2] == 0


# ---- OpenAI's Conversations API: items and metadata -----------------------------------------------


def sdk(server: PlatformServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def texts(items: list) -> list[str]:
    return [item.content[0].text for item in items]


QUESTION_ITEM = {"type": "message", "role": "user", "content": "Where is the lake?"}
ANSWER_ITEM = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Up the valley."}]}


def test_the_openai_sdk_creates_updates_lists_and_deletes_conversations_and_items(server: PlatformServer) -> None:
    client = sdk(server)
    created = client.conversations.create(items=[QUESTION_ITEM, ANSWER_ITEM], metadata={"topic": "travel"})
    conversation_id = created.id
    assert (created.object, created.metadata) == ("conversation", {"topic": "travel"})
    assert client.conversations.retrieve(conversation_id).metadata == {"topic": "travel"}
    updated = client.conversations.update(conversation_id, metadata={"topic": "food", "day": "2"})
    assert updated.metadata == client.conversations.retrieve(conversation_id).metadata == {"topic": "food", "day": "2"}

    newest_first = client.conversations.items.with_raw_response.list(conversation_id).http_response.json()
    answer_id, question_id = [item["id"] for item in newest_first["data"]]
    assert newest_first == {"object": "list", "first_id": answer_id, "last_id": question_id, "has_more": False, "data": [
        {"type": "message", "id": answer_id, "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Up the valley.", "annotations": [], "logprobs": []}]},
        {"type": "message", "id": question_id, "status": "completed", "role": "user",
         "content": [{"type": "input_text", "text": "Where is the lake?"}]},
    ]}
    ItemPage.model_validate(newest_first)  # as documented

    added = client.conversations.items.create(conversation_id, items=[
        {"role": "user", "content": [{"type": "input_text", "text": "And the hotel?"}]},
        {"role": "assistant", "content": "By the shore."},
    ])
    assert [(item.role, item.content[0].type) for item in added.data] == [("user", "input_text"),
                                                                          ("assistant", "output_text")]
    assert texts(added.data) == ["And the hotel?", "By the shore."] and added.has_more is False
    oldest_first = client.conversations.items.list(conversation_id, order="asc").data
    assert texts(oldest_first) == ["Where is the lake?", "Up the valley.", "And the hotel?", "By the shore."]
    assert [item.id for item in oldest_first] == [question_id, answer_id, *(item.id for item in added.data)]
    first = client.conversations.items.list(conversation_id, order="asc", limit=3)
    second = client.conversations.items.list(conversation_id, order="asc", limit=3, after=first.last_id)
    assert (texts(first.data), first.has_more) == (texts(oldest_first[:3]), True)
    assert (texts(second.data), second.has_more) == (["By the shore."], False)
    assert texts(client.conversations.items.list(conversation_id, limit=2).data) == ["By the shore.", "And the hotel?"]
    every_page = [item.id for item in client.conversations.items.list(conversation_id, limit=1)]  # the SDK pages on
    assert every_page == [item.id for item in reversed(oldest_first)]

    assert client.conversations.items.retrieve(answer_id, conversation_id=conversation_id) == oldest_first[1]
    after_delete = client.conversations.items.delete(answer_id, conversation_id=conversation_id)
    assert (after_delete.id, after_delete.object, after_delete.metadata) == (
        conversation_id, "conversation", {"topic": "food", "day": "2"})
    assert texts(client.conversations.items.list(conversation_id, order="asc").data) == [
        "Where is the lake?", "And the hotel?", "By the shore."]
    with pytest.raises(openai.NotFoundError) as gone:
        client.conversations.items.retrieve(answer_id, conversation_id=conversation_id)
    assert gone.value.code == "item_not_found"

    deleted = client.conversations.delete(conversation_id)
    assert (deleted.id, deleted.deleted) == (conversation_id, True)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation_id)


def test_a_chat_continues_a_conversation_made_of_items_as_if_sent_whole(server: PlatformServer) -> None:
    history = [{"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Name a lake."},
               {"role": "assistant", "content": "Como."}]
    question = {"role": "user", "content": "And a mountain?"}
    conversation = sdk(server).conversations.create(items=history)
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    with server.client() as client:
        continued = client.post("/v1/chat/completions",
                                json={**greedy, "messages": [question], "conversation_id": conversation.id})
        whole = client.post("/v1/chat/completions", json={**greedy, "messages": [*history, question]})
        alone = client.post("/v1/chat/completions", json={**greedy, "messages": [question]})
    assert continued.status_code == whole.status_code == alone.status_code == 200, continued.text
    assert continued.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
    assert continued.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"]
    reply = continued.json()["choices"][0]["message"]["content"]
    assert reply == whole.json()["choices"][0]["message"]["content"]
    stored = sdk(server).conversations.items.list(conversation.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in stored] == [
        *((m["role"], m["content"]) for m in history), ("user", question["content"]), ("assistant", reply)]


@pytest.fixture(scope="module")
def qwen3_engine(tiny_qwen3_dir: Path) -> Iterator[AsyncLLM]:
    with tiny_engine_running(tiny_qwen3_dir, num_kv_blocks=256, max_num_batched_tokens=256) as engine:
        yield engine


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", MODES)
def test_a_reasoning_reply_is_stored_as_its_reasoning_then_its_answer(
    qwen3_engine: AsyncLLM, tiny_qwen3_dir: Path, tmp_path: Path, mode: str, stream: bool
) -> None:
    """A chat turn of a reasoning model (--reasoning-parser qwen3) keeps its reasoning as an item of its own and
    its answer as the assistant's message, as the client got them, not the raw `<think>` text; the next turn's
    prompt holds the answer alone, as the whole conversation sent as messages does."""
    spec = ModelSpec(MODEL, engine=qwen3_engine, root=str(tiny_qwen3_dir), reasoning_parser="qwen3")
    with contextlib.contextmanager(serve_platform)(qwen3_engine, tmp_path, models=[spec], mode=mode) as server:
        conversation = sdk(server).conversations.create().id
        # With thinking off the constraint applies from the first token, so the regex writes a thought.
        # (The budget, which the gateway passes on too, does not apply: the template closed the prompt's reasoning.)
        thinks = {"guided_regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}", "temperature": 0, "max_tokens": 40,
                  "chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 1}
        question = {"role": "user", "content": "What is the weather?"}
        body = {"model": MODEL, "messages": [question], "conversation_id": conversation, "stream": stream, **thinks}
        with server.client() as client:
            first = client.post("/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            reasoning, answer = _reasoning_and_answer(first, stream)
            assert reasoning and answer and "<think>" not in answer
            # The usage counts reasoning tokens, through the gateway too: here a reply all of reasoning (its turn
            # opened with <think>).
            opened = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "stream": stream, "store": True,
                      "stream_options": {"include_usage": True} if stream else None, "continue_final_message": True,
                      "add_generation_prompt": False,
                      "messages": [question, {"role": "assistant", "content": "<think>\n"}]}
            thought = client.post("/v1/chat/completions", json=opened)
            assert thought.status_code == 200, thought.text
            usage = (json.loads([data for _, data in sse_events(iter(thought.text.splitlines()))][-2])
                     if stream else thought.json())["usage"]
            assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 6
            completion_id = (json.loads(sse_events(iter(thought.text.splitlines()))[0][1]) if stream
                             else thought.json())["id"]
            stored = client.get(f"/v1/chat/completions/{completion_id}").json()  # as kept (`store`)
            assert stored["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
            items = client.get(f"/v1/conversations/{conversation}/items", params={"order": "asc"}).json()["data"]
            assert [(item["type"], item.get("role")) for item in items] == [
                ("message", "user"), ("reasoning", None), ("message", "assistant")]
            assert items[1]["content"] == [{"type": "reasoning_text", "text": reasoning}]
            assert items[2]["content"][0]["text"] == answer

            follow_up = {"role": "user", "content": "And tomorrow?"}
            greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                      "chat_template_kwargs": {"enable_thinking": False}}
            continued = client.post("/v1/chat/completions",
                                    json={**greedy, "messages": [follow_up], "conversation_id": conversation})
            whole = client.post("/v1/chat/completions", json={
                **greedy, "messages": [question, {"role": "assistant", "content": answer}, follow_up]})
        assert continued.status_code == whole.status_code == 200, continued.text
        assert continued.json()["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]
        assert continued.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]


def _reasoning_and_answer(response: httpx.Response, stream: bool) -> tuple[str, str]:
    if not stream:
        message = response.json()["choices"][0]["message"]
        return message.get("reasoning_content") or "", message.get("content") or ""
    pieces = {"reasoning_content": "", "content": ""}
    for _, data in sse_events(iter(response.text.splitlines())):
        if data.startswith("{"):
            for choice in json.loads(data)["choices"]:
                for field in pieces:
                    pieces[field] += choice["delta"].get(field) or ""
    return pieces["reasoning_content"], pieces["content"]


def test_image_items_are_stored_as_a_chat_turns_images(server: PlatformServer) -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    item = {"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                        {"type": "input_image", "image_url": url},
                                        {"type": "input_text", "text": "this?"}]}
    with server.client() as client:
        conversation_id = client.post("/v1/conversations", json={"items": [item]}).json()["id"]
        items = client.get(f"/v1/conversations/{conversation_id}/items").json()
        messages = client.get(f"/v1/conversations/{conversation_id}/messages").json()
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "What is "},
                                           {"type": "input_image", "image_url": url, "detail": "auto"},
                                           {"type": "input_text", "text": "this?"}]
    ItemPage.model_validate(items)
    assert (messages["data"][0]["content"], messages["data"][0]["images"]) == ("What is this?", [url])
    stored = server.platform.conversations.get(None, conversation_id).messages[0]
    assert stored.parts == [{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": "this?"}]


def test_items_a_stored_conversation_cannot_keep_are_400s(server: PlatformServer) -> None:
    client = sdk(server)
    conversation_id = client.conversations.create(items=[QUESTION_ITEM]).id
    refused = {
        "items[0].type": lambda: client.conversations.items.create(conversation_id, items=[
            {"type": "file_search_call", "id": "fs_1", "queries": ["x"], "status": "completed"}]),
        "items[1].type": lambda: client.conversations.create(items=[
            QUESTION_ITEM, {"type": "web_search_call", "id": "ws_1", "status": "completed",
                            "action": {"type": "search", "query": "weather"}}]),
        "include": lambda: client.conversations.items.list(conversation_id, include=["message.output_text.logprobs"]),
        "items[0].content[1].type": lambda: client.conversations.items.create(conversation_id, items=[
            {"role": "user", "content": [{"type": "input_text", "text": "read"},
                                         {"type": "input_file", "file_id": "file_1"}]}]),
        "items[0].content[0]": lambda: client.conversations.items.create(conversation_id, items=[
            {"role": "assistant", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
    }
    for param, call in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            call()
        assert error.value.param == param
    with server.client() as http:
        plain_include = http.get(f"/v1/conversations/{conversation_id}/items",
                                 params={"include": "message.output_text.logprobs"})
        both = http.post("/v1/conversations", json={"items": [QUESTION_ITEM], "messages": turns("a")})
        too_many = http.post(f"/v1/conversations/{conversation_id}/items", json={"items": [QUESTION_ITEM] * 21})
        none = http.post(f"/v1/conversations/{conversation_id}/items", json={"items": []})
    for response, param in ((plain_include, "include"), (both, "items"), (too_many, "items"), (none, "items")):
        assert response.status_code == 400 and error_of(response)["param"] == param, response.text
    assert texts(client.conversations.items.list(conversation_id).data) == ["Where is the lake?"]  # nothing added
    assert client.conversations.create(items=[]).metadata == {}  # how the Agents SDK starts a session


def test_items_past_the_limits_are_413s_and_none_of_them_is_stored(server: PlatformServer) -> None:
    server.platform.conversations = ConversationStore(
        server.database, ConversationLimits(max_message_bytes=8, max_messages=3))
    with server.client() as client:
        created = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "a"}]})
        conversation_id = created.json()["id"]
        url = f"/v1/conversations/{conversation_id}/items"
        too_large = client.post(url, json={"items": [{"role": "user", "content": "fine"},
                                                     {"role": "user", "content": "too large"}]})
        too_long = client.post(url, json={"items": [{"role": "user", "content": str(i)} for i in range(3)]})
        stored = client.get(url).json()["data"]
    assert too_large.status_code == 413 and error_of(too_large)["param"] == "items[1].content"
    assert "items[1] has 9" in error_of(too_large)["message"]
    assert too_long.status_code == 413 and error_of(too_long)["code"] == "conversation_too_long"
    assert len(stored) == 1


def test_another_keys_conversation_and_unknown_items_are_404s(server: PlatformServer) -> None:
    owner, stranger = sdk(server, server.new_key("owner")[1]), sdk(server, server.new_key("stranger")[1])
    conversation_id = owner.conversations.create(items=[QUESTION_ITEM]).id
    item_id = owner.conversations.items.list(conversation_id).data[0].id
    elsewhere = owner.conversations.items.list(owner.conversations.create(items=[ANSWER_ITEM]).id).data[0].id
    foreign = [
        lambda: stranger.conversations.items.list(conversation_id),
        lambda: stranger.conversations.items.create(conversation_id, items=[QUESTION_ITEM]),
        lambda: stranger.conversations.items.retrieve(item_id, conversation_id=conversation_id),
        lambda: stranger.conversations.items.delete(item_id, conversation_id=conversation_id),
        lambda: stranger.conversations.update(conversation_id, metadata={"mine": "now"}),
    ]
    unknown = [
        lambda: owner.conversations.items.retrieve("msg_unknown", conversation_id=conversation_id),
        lambda: owner.conversations.items.delete("msg_unknown", conversation_id=conversation_id),
        lambda: owner.conversations.items.delete(elsewhere, conversation_id=conversation_id),
    ]
    for calls, code in ((foreign, "conversation_not_found"), (unknown, "item_not_found")):
        for call in calls:
            with pytest.raises(openai.NotFoundError) as error:
                call()
            assert error.value.code == code
    conversation = owner.conversations.retrieve(conversation_id)
    assert conversation.metadata == {} and [i.id for i in owner.conversations.items.list(conversation_id)] == [item_id]
