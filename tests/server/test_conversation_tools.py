"""Tools in stored conversations, in `llmserve serve`'s platform and in `llmserve gateway`'s: a chat turn that
offered tools keeps the calls its reply made, a tool message keeps the call it answers, and the next turn's prompt
is exactly that of the whole conversation sent as messages; a Responses request's function calls and their outputs
go into its `conversation` the same way; and OpenAI's Conversations items API reads and writes function calls,
their outputs and reasoning (the `openai` SDK parses them), as the OpenAI Agents SDK's conversations session uses it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.memory import OpenAIConversationsSession

from llmserve.engine.async_llm import AsyncLLM
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

SYSTEM = "Be brief."
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"]}}}
CALL_IT = {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
           "max_completion_tokens": 60}


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


def _chat(client: httpx.Client, messages: list[dict], **extra) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_completion_tokens": 8, "messages": messages, **extra}
    if not body.get("stream"):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    response = client.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"id": delta.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += delta.get("function", {}).get("name") or ""
                call["function"]["arguments"] += delta.get("function", {}).get("arguments") or ""
    return {"choices": [{"message": {"content": None, "tool_calls": [calls[i] for i in sorted(calls)]}}],
            "usage": chunks[-1]["usage"]}


def _conversation(client: httpx.Client, **body) -> str:
    response = client.post("/v1/conversations", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _items(client: httpx.Client, conversation: str) -> list[dict]:
    response = client.get(f"/v1/conversations/{conversation}/items", params={"order": "asc", "limit": 100})
    assert response.status_code == 200, response.text
    return response.json()["data"]


def _shape(item: dict) -> tuple:
    """An item without its id: what it says."""
    if item["type"] == "message":
        return ("message", item["role"], "".join(part["text"] for part in item["content"]))
    if item["type"] == "function_call":
        return ("function_call", item["call_id"], item["name"], item["arguments"])
    return ("function_call_output", item["call_id"], item["output"])


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_turn_in_a_conversation_continues_as_the_whole_conversation_sent_would(
    server: PlatformServer, stream: bool
) -> None:
    question = {"role": "user", "content": "What time is it in zone three?"}
    with server.client() as client:
        conversation = _conversation(client, messages=[{"role": "system", "content": SYSTEM}])
        called = _chat(client, [question], conversation_id=conversation, stream=stream, **CALL_IT)
        [call] = called["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"])["zone"] in range(
            -12, 13)
        output = {"role": "tool", "tool_call_id": call["id"], "content": "It is noon."}
        answered = _chat(client, [output], conversation_id=conversation, tools=[TOOL])
        whole = [{"role": "system", "content": SYSTEM}, question,
                 {"role": "assistant", "content": None, "tool_calls": [call]}, output]
        reference = _chat(client, whole, tools=[TOOL])
        reply = answered["choices"][0]["message"]["content"]
        assert reply == reference["choices"][0]["message"]["content"]
        assert answered["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        assert [_shape(item) for item in _items(client, conversation)] == [
            ("message", "system", SYSTEM), ("message", "user", question["content"]),
            ("function_call", call["id"], "get_time", call["function"]["arguments"]),
            ("function_call_output", call["id"], "It is noon."), ("message", "assistant", reply)]
        stored = client.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
        assert stored[2]["tool_call"] == {"call_id": call["id"], "name": "get_time",
                                          "arguments": call["function"]["arguments"]}
        assert stored[2]["role"] == "assistant" and stored[3]["tool_call_id"] == call["id"]
    assert server.idle_stats().num_used_blocks == 0


def test_function_calls_of_a_response_in_a_conversation_are_kept_as_items(server: PlatformServer) -> None:
    tool = {"type": "function", "name": "get_time", "parameters": TOOL["function"]["parameters"]}
    common = {"model": MODEL, "temperature": 0, "tools": [tool]}
    with server.client() as client:
        conversation = _conversation(client)
        first = client.post("/v1/responses", json={**common, "max_output_tokens": 60, "input": "What time is it?",
                                                   "conversation": conversation,
                                                   "tool_choice": {"type": "function", "name": "get_time"}}).json()
        [call] = [item for item in first["output"] if item["type"] == "function_call"]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "It is noon."}
        second = client.post("/v1/responses", json={**common, "max_output_tokens": 8, "input": [output],
                                                    "conversation": conversation}).json()
        whole = [{"role": "user", "content": "What time is it?"},
                 {"type": "function_call", "call_id": call["call_id"], "name": "get_time",
                  "arguments": call["arguments"]}, output]
        reference = client.post("/v1/responses", json={**common, "max_output_tokens": 8, "input": whole,
                                                       "store": False}).json()
        text = "".join(part["text"] for item in second["output"] if item["type"] == "message"
                       for part in item["content"])
        assert second["output"] == [{**item, "id": second_item["id"]}
                                    for item, second_item in zip(reference["output"], second["output"], strict=True)]
        assert second["usage"]["input_tokens"] == reference["usage"]["input_tokens"]
        assert [_shape(item) for item in _items(client, conversation)] == [
            ("message", "user", "What time is it?"),
            ("function_call", call["call_id"], "get_time", call["arguments"]),
            ("function_call_output", call["call_id"], "It is noon."), ("message", "assistant", text)]
    assert server.idle_stats().num_used_blocks == 0


def test_items_api_writes_and_reads_function_calls_and_their_outputs(server: PlatformServer) -> None:
    """A conversation built of items (a reply with text and two parallel calls, their outputs) continues as the
    chat messages they add up to: the calls join the reply's message."""
    calls = [{"type": "function_call", "call_id": f"call_{zone}", "name": "get_time",
              "arguments": json.dumps({"zone": zone})} for zone in (1, 2)]
    outputs = [{"type": "function_call_output", "call_id": "call_1", "output": "It is one."},
               {"type": "function_call_output", "call_id": "call_2",
                "output": [{"type": "input_text", "text": "It is "}, {"type": "input_text", "text": "two."}]}]
    with server.client() as client:
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        conversation = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "Times?"}]).id
        added = sdk.conversations.items.create(conversation, items=[
            {"type": "message", "role": "assistant", "content": "Looking."}, *calls, *outputs])
        assert [item.type for item in added.data] == ["message", "function_call", "function_call", *[
            "function_call_output"] * 2]
        assert [(item.call_id, item.name, item.arguments) for item in added.data[1:3]] == [
            (c["call_id"], c["name"], c["arguments"]) for c in calls]
        assert [item.output for item in added.data[3:]] == ["It is one.", "It is two."]
        listed = sdk.conversations.items.list(conversation, order="asc")
        assert [item.id for item in listed.data] == [_items(client, conversation)[0]["id"],
                                                     *(item.id for item in added.data)]
        call_item = sdk.conversations.items.retrieve(added.data[1].id, conversation_id=conversation)
        assert (call_item.type, call_item.call_id) == ("function_call", "call_1")
        assert added.data[1].id.startswith("fc_") and added.data[3].id.startswith("fco_")

        asked = _chat(client, [{"role": "user", "content": "Thanks."}], conversation_id=conversation)
        whole = [{"role": "user", "content": "Times?"},
                 {"role": "assistant", "content": "Looking.", "tool_calls": [
                     {"id": c["call_id"], "type": "function", "function": {"name": c["name"],
                                                                           "arguments": c["arguments"]}}
                     for c in calls]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "It is one."},
                 {"role": "tool", "tool_call_id": "call_2", "content": "It is two."},
                 {"role": "user", "content": "Thanks."}]
        reference = _chat(client, whole)
        assert asked["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        assert asked["choices"][0]["message"] == reference["choices"][0]["message"]

        deleted = client.delete(f"/v1/conversations/{conversation}/items/{added.data[2].id}")
        assert deleted.status_code == 200
        assert [_shape(item)[0] for item in _items(client, conversation)].count("function_call") == 1
    assert server.idle_stats().num_used_blocks == 0


def test_reasoning_items_are_kept_as_sent_and_left_out_of_the_prompt(server: PlatformServer) -> None:
    """As the Agents SDK's session adds a reasoning model's output: the reasoning item is listed back as it was
    sent (the SDK parses it), and the next turn's prompt leaves it out, as chat templates leave out earlier turns'
    reasoning."""
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Noon is twelve."}],
                 "content": [{"type": "reasoning_text", "text": "They ask "}, {"type": "reasoning_text", "text": "the time."}],
                 "encrypted_content": "VGhleSBhc2s="}
    question = {"type": "message", "role": "user", "content": "What time is it?"}
    answer = {"type": "message", "role": "assistant", "content": "Noon."}
    with server.client() as client:
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        conversation = sdk.conversations.create(items=[question, reasoning, answer]).id
        [listed] = [item for item in sdk.conversations.items.list(conversation, order="asc").data
                    if item.type == "reasoning"]
        assert listed.id.startswith("rs_") and listed.model_dump(exclude_unset=True, exclude={"id", "status"}) == {
            "type": "reasoning", "summary": reasoning["summary"], "encrypted_content": "VGhleSBhc2s=",
            "content": [{"type": "reasoning_text", "text": "They ask the time."}]}
        asked = _chat(client, [{"role": "user", "content": "Thanks."}], conversation_id=conversation)
        reference = _chat(client, [{"role": "user", "content": "What time is it?"},
                                   {"role": "assistant", "content": "Noon."}, {"role": "user", "content": "Thanks."}])
        assert asked["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        assert asked["choices"][0]["message"] == reference["choices"][0]["message"]
    assert server.idle_stats().num_used_blocks == 0


def test_a_responses_output_joins_its_conversation_as_its_items() -> None:
    """A reasoning model's answer that thinks, writes and calls: its conversation keeps the reasoning, the text and
    the call as three items, in that order (the `_Keeper` of a request with `conversation` saves this turn)."""
    from llmserve.server.conversation_items import stored_turns
    from llmserve.server.responses_api import _output_message

    output = [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
              {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
              {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_time", "arguments": "{}",
               "status": "completed"}]
    assert stored_turns([_output_message(output)]) == [
        {"role": "assistant", "content": "Hm.", "reasoning": {"summary": []}},
        {"role": "assistant", "content": "Checking."},
        {"role": "assistant", "content": "", "tool_call": {"call_id": "call_1", "name": "get_time", "arguments": "{}"}}]


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "items[0].call_id"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "items[0].name"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "items[0].arguments"),
    ({"type": "function_call_output", "output": "x"}, "items[0].call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "items[0].output"),
    ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "x"}]},
     "items[0].output"),
    ({"type": "file_search_call", "id": "fs_1", "queries": ["x"], "status": "completed"}, "items[0].type"),
    ({"type": "reasoning"}, "items[0].summary"),
    ({"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "x"}]}, "items[0].summary"),
    ({"type": "reasoning", "summary": [], "content": [{"type": "summary_text", "text": "x"}]}, "items[0].content"),
    ({"type": "reasoning", "summary": [], "encrypted_content": 3}, "items[0].encrypted_content"),
    ({"type": "function_call", "call_id": "c" * 256, "name": "f", "arguments": "{}"}, "items[0].call_id"),
])
def test_malformed_tool_items_are_400s_naming_the_field(server: PlatformServer, item: dict, param: str) -> None:
    with server.client() as client:
        conversation = _conversation(client)
        refused = client.post(f"/v1/conversations/{conversation}/items", json={"items": [item]})
        assert refused.status_code == 400 and _error(refused)["param"] == param, refused.text
        assert _items(client, conversation) == []


def test_an_openai_agent_keeps_its_tool_calls_in_a_conversations_session(server: PlatformServer) -> None:
    """The OpenAI Agents SDK's server-side session: a run that calls a function tool leaves the question, the call
    and its output in the conversation; the next run reads them back as its input and adds its own turn."""
    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    zones: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a time zone."""
        zones.append(zone)
        return "noon"

    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    clock = Agent(name="clock", instructions=SYSTEM, model=model, tools=[get_time], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="get_time", max_tokens=60, temperature=0))
    # A reply under a schema: it ends (completed) where free text from random weights would run out of tokens
    judge = Agent(name="judge", instructions=SYSTEM, model=model, output_type=bool,
                  model_settings=ModelSettings(max_tokens=60, temperature=0))

    async def two_runs() -> tuple[str, object, list[dict], list[dict], str]:
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(clock, "What time is it?", session=session)
        after_first = await session.get_items()
        second = await Runner.run(judge, "Is it noon?", session=session)
        return first.final_output, second.final_output, after_first, await session.get_items(), session.session_id

    answer, judged, after_first, after_second, conversation = asyncio.run(two_runs())
    assert answer == "noon" and len(zones) == 1 and zones[0] in ("UTC", "CET") and isinstance(judged, bool)
    assert [item["type"] for item in after_first] == ["message", "function_call", "function_call_output"]
    call, output = after_first[1:]
    assert (call["name"], json.loads(call["arguments"]), output["call_id"], output["output"]) == (
        "get_time", {"zone": zones[0]}, call["call_id"], "noon")
    assert after_second[:3] == after_first
    assert [(item["type"], item.get("role")) for item in after_second[3:]] == [("message", "user"),
                                                                               ("message", "assistant")]
    with server.client() as http:
        stored = http.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "user", "assistant"]
    assert server.idle_stats().num_used_blocks == 0
