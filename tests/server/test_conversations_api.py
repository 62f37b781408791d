"""/v1/conversations over HTTP: the limits on what a conversation holds (413), its messages a page at
a time, 400s for bad cursors (SQLite and PostgreSQL), and a long conversation fitted into the context
window by `truncation: "auto"`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.cli import build_parser
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.conversations import ConversationLimits, ConversationStore
from llmserve.server.conversations import TRUNCATED_HEADER, fit_history
from llmserve.server.platform_options import conversation_limits
from llmserve.store.db import open_database
from tests.server.conftest import MAX_MODEL_LEN
from tests.server.platform_fixtures import (
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
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
