"""OpenAI's Responses API (`POST /v1/responses`) through the openai client, on the random-weight tiny model:
each answer is the chat completion of the same conversation (exact text, usage), in output items; streamed,
the client's own event models parse every event and the deltas add up to the final response; tools,
`text.format` and the 400s in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from llmserve.server.streaming import PROGRESS_HEADER
from tests.server.conftest import LiveServer, serving

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                         "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir) -> Iterator[LiveServer]:
    with serving(tiny_llama_dir, max_num_batched_tokens=256, max_model_len=2048) as server:
        yield server


def _chat_text(server: LiveServer, messages: list[dict], **body) -> tuple[str | None, dict]:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": server.model, "messages": messages, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["message"]["content"], answer["usage"]


def test_a_response_is_the_chat_completion_of_the_same_conversation(live_server: LiveServer) -> None:
    client = live_server.client()
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "tomorrow?"}]},
    ]
    # max_tool_calls bounds calls of built-in tools, which this server runs none of: it changes nothing
    response = client.responses.create(model=live_server.model, instructions="Be brief.", input=history, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_output_tokens=24, max_tool_calls=1)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    # a Responses function tool is strict unless it says otherwise
    chat_tool = {"type": "function", "function": {**{k: WEATHER[k] for k in ("name", "description", "parameters")},
                                                  "strict": True}}
    text, usage = _chat_text(live_server, messages, tools=[chat_tool], tool_choice="none", max_completion_tokens=24)
    assert response.output_text == text and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage["prompt_tokens"], 24)
    assert response.id.startswith("resp_") and response.output[0].type == "message" and response.max_tool_calls == 1
    # the client builds its models without validating them: validated here, the JSON as sent
    raw = httpx.post(f"{live_server.base_url}/v1/responses", timeout=60, json={
        "model": live_server.model, "input": history, "tools": [WEATHER], "max_output_tokens": 4})
    Response.model_validate_json(raw.content)
    # a client sending the gateway's progress header still gets the JSON (the chat answers in events then)
    progress = httpx.post(f"{live_server.base_url}/v1/responses", headers={PROGRESS_HEADER: "1"}, timeout=60,
                          json={"model": live_server.model, "input": "hi", "max_output_tokens": 4})
    assert progress.status_code == 200 and Response.model_validate_json(progress.content).usage.output_tokens == 4
    assert live_server.idle_stats().num_used_blocks == 0


def test_streamed_events_parse_and_add_up_to_the_response(live_server: LiveServer) -> None:
    client = live_server.client()
    whole = client.responses.create(model=live_server.model, input="Tell me a story.", temperature=0,
                                    max_output_tokens=20)
    with client.responses.stream(model=live_server.model, input="Tell me a story.", temperature=0,
                                 max_output_tokens=20) as stream:
        events = list(stream)
    final = events[-1].response  # cut short: `response.incomplete` (the client's get_final_response wants completed)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and len(deltas) > 0
    assert final.usage.output_tokens == whole.usage.output_tokens == 20
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    body = {"model": live_server.model, "input": "Tell me a story.", "max_output_tokens": 5, "stream": True}
    raw = httpx.post(f"{live_server.base_url}/v1/responses", json=body, timeout=60)
    data = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert len(data) > 5 and all(TypeAdapter(ResponseStreamEvent).validate_json(event) for event in data)


def test_required_tool_calls_come_back_as_function_call_items(live_server: LiveServer) -> None:
    client = live_server.client()
    for seed_input in ("Weather in Oslo?", "Weather in Rome?"):
        response = client.responses.create(model=live_server.model, input=seed_input, tools=[WEATHER],
                                           tool_choice="required", max_output_tokens=300)
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and all(call.name == "get_weather" and call.call_id.startswith("call_") for call in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    raw = httpx.post(f"{live_server.base_url}/v1/responses", timeout=60, json={
        "model": live_server.model, "input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
        "max_output_tokens": 300})
    assert Response.model_validate_json(raw.content).output[0].type == "function_call"
    with client.responses.stream(model=live_server.model, input="Weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=300) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments and json.loads(call.arguments)["unit"] in ("c", "f")


def test_text_format_json_schema_holds(live_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    client = live_server.client()
    for seed in range(3):
        response = client.responses.create(
            model=live_server.model, input=f"A number, please ({seed}).", max_output_tokens=32,
            text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
        )
        jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input[0].content[0]",
     "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", None),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", None),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"max_output_tokens": 10**6}, "max_output_tokens", None),
    ({"max_tool_calls": 0}, "max_tool_calls", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "intger"}}}}, "text.format", None),
    ({"truncation": "middle"}, "truncation", None),
    ({"background": True}, "background", "unsupported_parameter"),  # without the platform, nothing is stored
    ({"text": {"format": "json"}}, "text.format", None),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict", None),
])
def test_bad_requests_are_400s_naming_the_field(live_server: LiveServer, body: dict, param: str,
                                                code: str | None) -> None:
    payload = {"model": live_server.model, "input": "hi", **body}
    response = httpx.post(f"{live_server.base_url}/v1/responses", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    assert live_server.idle_stats().num_used_blocks == 0


def test_a_client_that_hangs_up_mid_stream_aborts_its_generation(live_server: LiveServer) -> None:
    aborted_before = live_server.engine.num_aborted
    body = {"model": live_server.model, "input": "Tell me a long story.", "max_output_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{live_server.base_url}/v1/responses", json=body, timeout=60) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line.startswith("event: response.output_text.delta")
            if deltas == 3:
                break  # leaving the block closes the connection mid-stream
    stats = live_server.idle_stats()
    assert stats.num_used_blocks == 0 and live_server.engine.num_aborted - aborted_before == 1


def _chat_chunks(*deltas: dict, finish_reason: str = "tool_calls") -> list[str]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "qwen"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    chunks += [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish_reason}]})
    chunks.append({**head, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}})
    return [f"id: {i}\ndata: {json.dumps(chunk)}\n\n" for i, chunk in enumerate(chunks)] + ["data: [DONE]\n\n"]


def test_reasoning_text_and_calls_become_items_in_order_as_the_client_reads_them() -> None:
    """Chat's chunks of a reasoning model that thinks, answers and calls two tools (split across reads
    anywhere): the events the openai client's models accept, an item per kind in order, and the texts
    and arguments whole in the done events and the final response."""
    from llmserve.server.responses_output import ResponseEvents
    from llmserve.server.responses_protocol import ResponsesRequest

    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    text = "".join(_chat_chunks(
        {"reasoning_content": "Let me"}, {"reasoning_content": " think."}, {"content": "Checking."},
        {"tool_calls": [call]}, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
        {"tool_calls": [{**second, "function": {**second["function"], "arguments": "{}"}}]},
    ))

    async def chunks():  # the same stream cut at arbitrary points
        for start in range(0, len(text), 37):
            yield text[start:start + 37]

    async def events() -> list[str]:
        body = ResponsesRequest(model="qwen", input="hi", stream=True)
        return [event async for event in ResponseEvents(body, "resp_1").events(chunks())]

    parsed = [TypeAdapter(ResponseStreamEvent).validate_json(event.split("data: ", 1)[1]) for event in asyncio.run(events())]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    added = [event.item.type for event in parsed if event.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    final = Response.model_validate(parsed[-1].response.model_dump())
    assert parsed[-1].type == "response.completed" and final.status == "completed"
    reasoning, message, weather, time_call = final.output
    assert reasoning.content[0].text == "Let me think." and message.content[0].text == "Checking."
    assert (weather.call_id, weather.name, weather.arguments) == ("call_a", "get_weather", '{"city": "Oslo"}')
    assert (time_call.call_id, time_call.arguments) == ("call_b", "{}")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 9) and final.model == "qwen"
    done = [event.arguments for event in parsed if event.type == "response.function_call_arguments.done"]
    assert done == ['{"city": "Oslo"}', "{}"]


def test_output_text_logprobs_are_chats_whole_and_streamed(live_server: LiveServer) -> None:
    """include message.output_text.logprobs with top_logprobs: the output text's logprobs are the chat
    completion's, and the streamed deltas' add up to them."""
    client = live_server.client()
    asked = dict(model=live_server.model, input="Tell me a story.", temperature=0, max_output_tokens=5,
                 include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**asked)
    chat = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": live_server.model, "messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0,
        "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2}).json()
    expected = chat["choices"][0]["logprobs"]["content"]
    got = [logprob.model_dump() for logprob in whole.output[0].content[0].logprobs]
    assert len(got) == 5 and [(g["token"], g["logprob"]) for g in got] == [(e["token"], e["logprob"]) for e in expected]
    assert all(len(g["top_logprobs"]) == 2 for g in got)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [g["token"] for g in got]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == streamed
    plain = client.responses.create(**{k: v for k, v in asked.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs == []


def test_encrypted_reasoning_is_its_text_for_a_stateless_client_to_send_back() -> None:
    """include reasoning.encrypted_content: each reasoning item carries its text (base64, not encrypted);
    sent back as input, a reasoning item is left out of the prompt as chat templates leave earlier reasoning."""
    import base64

    from llmserve.server.responses_api import _messages
    from llmserve.server.responses_output import ResponseEvents
    from llmserve.server.responses_protocol import ResponsesRequest

    text = "".join(_chat_chunks({"reasoning_content": "Let me think."}, {"content": "Hi."}, finish_reason="stop"))

    async def events(include: list[str] | None) -> list[str]:
        async def chunks():
            yield text

        body = ResponsesRequest(model="qwen", input="hi", stream=True, include=include)
        return [event async for event in ResponseEvents(body, "resp_1").events(chunks())]

    for include, expected in ((["reasoning.encrypted_content"], base64.b64encode(b"Let me think.").decode()),
                              (None, None)):
        final = json.loads(asyncio.run(events(include))[-1].split("data: ", 1)[1])["response"]
        reasoning = Response.model_validate(final).output[0]
        assert reasoning.type == "reasoning" and reasoning.encrypted_content == expected
    sent_back = [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "TGV0"},
                 {"role": "user", "content": "More?"}]
    assert _messages([], sent_back) == [{"role": "user", "content": "More?"}]


def test_an_unknown_include_is_a_400_naming_it(live_server: LiveServer) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/responses", timeout=60, json={
        "model": live_server.model, "input": "hi", "include": ["message.output_text.logprobs", "everything"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "include[1]", response.text


def test_input_tokens_without_stored_responses_count_the_input_alone(live_server: LiveServer) -> None:
    """Without its platform the server counts a request's own instructions, input and tools; continuing a stored
    response is a 400 there, as creating one is."""
    body = {"model": live_server.model, "instructions": "Be brief.", "input": "What is two and two?"}
    made = httpx.post(f"{live_server.base_url}/v1/responses", json={**body, "max_output_tokens": 2}, timeout=60)
    counted = live_server.client().responses.input_tokens.count(**body)
    assert counted.input_tokens == made.json()["usage"]["input_tokens"]
    refused = httpx.post(f"{live_server.base_url}/v1/responses/input_tokens", timeout=60,
                         json={**body, "previous_response_id": "resp_1"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
