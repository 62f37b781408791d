"""Tool calling and structured output over HTTP, with the random-weight tiny model: forced tool calls
(tool_choice "required" or named) decode under the tools' schemas, so every call is valid; streamed
calls reassemble to the non-streamed one; response_format and vLLM's constraint fields hold; the
openai client's `.parse()` and LangChain's `with_structured_output` / `bind_tools` work end to end;
bad tool use is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import LiveServer, serving

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir) -> Iterator[LiveServer]:
    """The tiny model with room for the tools' descriptions (its small vocabulary spends many tokens on JSON)."""
    with serving(tiny_llama_dir, max_num_batched_tokens=256, max_model_len=2048) as server:
        yield server


def chat(server: LiveServer, **body) -> httpx.Response:
    payload = {"model": server.model, "messages": [{"role": "user", "content": "What is the weather?"}], **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=60)


def streamed_tool_calls(server: LiveServer, **body) -> tuple[list[dict], str | None, list[dict]]:
    """The calls reassembled from the stream's deltas, the finish reason, and the raw tool-call deltas."""
    calls: dict[int, dict] = {}
    raw: list[dict] = []
    finish_reason = None
    payload = {"model": server.model, "messages": [{"role": "user", "content": "What is the weather?"}],
               "stream": True, **body}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            finish_reason = choice["finish_reason"] or finish_reason
            for delta in choice["delta"].get("tool_calls") or []:
                raw.append(delta)
                call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in delta:
                    call["id"], call["name"] = delta["id"], delta["function"]["name"]
                call["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish_reason, raw


@pytest.mark.parametrize("seed", range(8))
def test_required_tool_choice_always_returns_valid_calls(live_server: LiveServer, seed: int) -> None:
    response = chat(live_server, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=500)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(live_server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(4):
        response = chat(live_server, tools=TOOLS, tool_choice=named, seed=seed, max_tokens=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time" and choice["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS["get_time"])


def test_without_parallel_tool_calls_there_is_exactly_one_call(live_server: LiveServer) -> None:
    for seed in range(4):
        response = chat(live_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
                        max_tokens=120)
        assert len(response.json()["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(live_server: LiveServer, tool_choice) -> None:
    body = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 0, "max_tokens": 500}
    whole = chat(live_server, **body).json()["choices"][0]
    streamed, finish_reason, raw = streamed_tool_calls(live_server, **body)
    assert finish_reason == whole["finish_reason"] == "tool_calls"
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for c in streamed] == expected
    assert "id" in raw[0] and raw[0]["function"]["name"]  # the id and name come first
    assert len(raw) > 2 * len(streamed)  # the arguments came in pieces


def test_tool_choice_auto_and_none_answer_with_content_from_the_random_model(live_server: LiveServer) -> None:
    for tool_choice in ("auto", "none"):
        response = chat(live_server, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=16)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"]


def test_strict_functions_under_auto_are_compiled_and_give_way_to_a_response_format(live_server: LiveServer) -> None:
    """The calls' grammar is built only with a strict function (an invalid schema is then a 400 naming
    tools); the random model answers in text (each call it would open is decoded under its schema:
    test_strict_tool_calls.py); a response_format holds alone, so the reply is its JSON."""
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    response = chat(live_server, tools=strict, tool_choice="auto", temperature=0, max_tokens=16)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "intger"}}}}}
    assert chat(live_server, tools=[broken], max_tokens=4).status_code == 200
    response = chat(live_server, tools=[{**broken, "function": {**broken["function"], "strict": True}}], max_tokens=4)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for seed in range(3):
        reply = chat(live_server, tools=strict, response_format=response_format, seed=seed, max_tokens=32).json()
        jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)
    assert live_server.idle_stats().num_used_blocks == 0


def test_tool_results_in_the_history_are_rendered_and_answered(live_server: LiveServer) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    with_result = chat(live_server, messages=messages, tools=TOOLS, max_tokens=4)
    assert with_result.status_code == 200, with_result.text
    without = chat(live_server, messages=messages[:1], tools=TOOLS, max_tokens=4)
    # The call and its result are in the prompt: the template rendered them.
    assert with_result.json()["usage"]["prompt_tokens"] > without.json()["usage"]["prompt_tokens"] + 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_use_is_a_400_naming_the_field(live_server: LiveServer, body: dict, param: str) -> None:
    response = chat(live_server, max_tokens=4, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


# ---- structured output -------------------------------------------------------------------------------


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]
    temperature: int = Field(ge=-40, le=50)
    raining: bool


def test_the_openai_clients_parse_returns_a_valid_object_every_time(live_server: LiveServer) -> None:
    client = live_server.client()
    for seed in range(50):
        completion = client.chat.completions.parse(
            model=live_server.model,
            messages=[{"role": "user", "content": "Weather report, please."}],
            response_format=Weather,
            seed=seed,
            max_tokens=80,
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Weather), completion.choices[0].message.content


def tagged_json(text: str, schema: dict) -> bool:
    """`<n>` + JSON under `schema` + `</n>`, the whole text."""
    assert text.startswith("<n>") and text.endswith("</n>"), text
    jsonschema.validate(json.loads(text[3:-4]), schema)
    return True


def test_response_format_and_vllms_constraint_fields_hold(live_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    tagged = {"type": "structural_tag", "format": {"type": "tag", "begin": "<n>", "end": "</n>",
                                                   "content": {"type": "json_schema", "json_schema": schema,
                                                               "max_whitespace_cnt": 1}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    for seed in range(3):
        text = chat(live_server, response_format=json_schema, seed=seed, max_tokens=32).json()
        jsonschema.validate(json.loads(text["choices"][0]["message"]["content"]), schema)
        obj = chat(live_server, response_format={"type": "json_object"}, seed=seed, max_tokens=200).json()
        choice = obj["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # the random model may still be writing its object
            assert choice["message"]["content"].startswith("{")
    completions = f"{live_server.base_url}/v1/completions"
    for body, check in (
        ({"guided_regex": r"[ab]{3}-\d{2}"}, lambda t: re.fullmatch(r"[ab]{3}-\d{2}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"json": schema}}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"structured_outputs": {"structural_tag": json.dumps(tagged)}}, lambda t: tagged_json(t, schema)),
        ({"response_format": {"type": "structural_tag", "format": tagged["format"]}}, lambda t: tagged_json(t, schema)),
    ):
        response = httpx.post(completions, json={"model": live_server.model, "prompt": "Answer:", "max_tokens": 32,
                                                 **body}, timeout=60)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        assert check(text), (body, text)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "intger"}}}}}}, "response_format"),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        ("completions", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {
            "type": "nope"}}}}, "structured_outputs"),
        ("chat/completions", {"response_format": {"type": "structural_tag", "triggers": ["<a"], "structures": [
            {"begin": "<a>", "schema": {"type": "object", "properties": {"a": {"type": "intger"}}}, "end": "</a>"}]}},
         "response_format"),
        ("chat/completions", {"response_format": {"type": "structural_tag", "triggers": ["<a"]}}, "response_format"),
    ],
)
def test_an_invalid_constraint_is_a_400_naming_its_field(live_server: LiveServer, endpoint: str, body: dict,
                                                         param: str) -> None:
    payload = {"model": live_server.model, "max_tokens": 4, **body}
    if endpoint == "completions":
        payload["prompt"] = "x"
    else:
        payload["messages"] = [{"role": "user", "content": "x"}]
    response = httpx.post(f"{live_server.base_url}/v1/{endpoint}", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "[" not in error["message"].split(":")[0]
    assert live_server.idle_stats().num_used_blocks == 0


# ---- LangChain ----------------------------------------------------------------------------------------


def test_langchain_with_structured_output_and_bind_tools(live_server: LiveServer) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=live_server.model, base_url=f"{live_server.base_url}/v1", api_key="x", max_tokens=80,
                     max_retries=0, seed=3)
    report = llm.with_structured_output(Weather, method="json_schema").invoke("Weather report, please.")
    assert isinstance(report, Weather)

    @tool
    def get_time(zone: int) -> str:
        """The time in a UTC offset zone."""
        return f"12:00 UTC{zone:+d}"

    message = llm.bind_tools([get_time], tool_choice="required").invoke("What time is it in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_time"
    assert isinstance(message.tool_calls[0]["args"]["zone"], int)


# ---- reasoning ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_server(tiny_qwen3_dir) -> Iterator[LiveServer]:
    """The tiny qwen3 model served with --reasoning-parser qwen3."""
    with serving(tiny_qwen3_dir, max_num_batched_tokens=256, max_model_len=2048, reasoning_parser="qwen3") as server:
        yield server


THOUGHT_THEN_ANSWER = r"<think>[a-z]{2,6}</think>[a-z]{2,6}"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the template closes an empty think block


def test_reasoning_goes_to_reasoning_content_streamed_and_not(reasoning_server: LiveServer) -> None:
    # With thinking off the constraint applies from the first token, so the regex writes a thought.
    body = {"guided_regex": THOUGHT_THEN_ANSWER, "temperature": 0, "max_tokens": 40, **NO_THINKING}
    message = chat(reasoning_server, **body).json()["choices"][0]["message"]
    assert re.fullmatch("[a-z]{2,6}", message["reasoning_content"]) and re.fullmatch("[a-z]{2,6}", message["content"])
    payload = {"model": reasoning_server.model, "messages": [{"role": "user", "content": "What is the weather?"}],
               "stream": True, **body}
    pieces = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", f"{reasoning_server.base_url}/v1/chat/completions", json=payload,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                for field in pieces:
                    pieces[field] += delta.get(field) or ""
    assert pieces == {"reasoning_content": message["reasoning_content"], "content": message["content"]}


def test_a_reply_without_reasoning_is_all_content(reasoning_server: LiveServer) -> None:
    message = chat(reasoning_server, temperature=0, max_tokens=8, **NO_THINKING).json()["choices"][0]["message"]
    assert message["content"] and "reasoning_content" not in message


def test_structured_output_starts_after_the_reasoning_unless_thinking_is_off(reasoning_server: LiveServer) -> None:
    from llmserve.server.assistant_output import plan_reply, reasoning_start
    from llmserve.server.protocol import ChatCompletionRequest

    (endpoint,) = reasoning_server.app.state.llmserve.endpoints()
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    tokenizer = reasoning_server.engine.tokenizer
    for variables, expected in (({}, endpoint.reasoning_end_ids), ({"enable_thinking": False}, [])):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               **variables)
        plan = plan_reply(body, endpoint.tool_parser, endpoint.reasoning)
        assert reasoning_start(plan, prompt, endpoint.reasoning_end_ids) == expected
    assert endpoint.reasoning_end_ids == tokenizer.encode("</think>", add_special_tokens=False)


# The reply continues an assistant turn opened with <think>: the reasoning runs from its first token.
THINKING = {"messages": [{"role": "user", "content": "What is the weather?"}, {"role": "assistant", "content": "<think>\n"}],
            "continue_final_message": True, "add_generation_prompt": False, "temperature": 0, "max_tokens": 12,
            "ignore_eos": True, "return_token_ids": True}


def test_a_thinking_budget_cuts_the_reasoning_at_that_many_tokens_and_closes_it(reasoning_server: LiveServer) -> None:
    tokenizer = reasoning_server.engine.tokenizer
    (endpoint,) = reasoning_server.app.state.llmserve.endpoints()
    end = endpoint.reasoning_end_ids  # "</think>", as this tokenizer spells it
    free = chat(reasoning_server, **THINKING).json()["choices"][0]
    assert free["message"]["reasoning_content"] and not free["message"]["content"]  # all of it reasoning
    capped = chat(reasoning_server, **THINKING, thinking_token_budget=4)
    assert capped.status_code == 200, capped.text
    choice = capped.json()["choices"][0]
    assert choice["token_ids"][: 4 + len(end)] == free["token_ids"][:4] + end
    assert choice["message"]["reasoning_content"] == tokenizer.decode(free["token_ids"][:4])
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"][4 + len(end):])
    # The usage counts the reasoning's tokens, its end tag's with them; streamed too.
    assert capped.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4 + len(end)
    assert chat(reasoning_server, **THINKING).json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    streamed = chat(reasoning_server, **THINKING, thinking_token_budget=4, stream=True,
                    stream_options={"include_usage": True})
    usage = json.loads([line for line in streamed.text.splitlines() if line.startswith("data: {")][-1][6:])["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 4 + len(end)
    # With thinking turned off the template closed the reasoning: there is none to cap.
    off = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **NO_THINKING}
    unthinking = chat(reasoning_server, **off).json()
    assert (chat(reasoning_server, **off, thinking_token_budget=0).json()["choices"][0]["token_ids"]
            == unthinking["choices"][0]["token_ids"])
    assert unthinking["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_thinking_budget_needs_a_reasoning_model_and_a_count(live_server: LiveServer,
                                                               reasoning_server: LiveServer) -> None:
    refused = chat(live_server, thinking_token_budget=4)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in refused.json()["error"]["message"]
    for bad in (-1, "many", 1.5):
        refused = chat(reasoning_server, thinking_token_budget=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget", bad
    beams = chat(reasoning_server, **THINKING, thinking_token_budget=2, use_beam_search=True, n=2)
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "thinking_token_budget"


def test_an_assistant_turn_sent_back_with_its_reasoning_is_taken(reasoning_server: LiveServer) -> None:
    """As the openai SDK sends a reply back (`messages.append(choice.message)`): its `reasoning_content` goes to the
    template, which keeps it in a tool loop (Qwen3's renders the reasoning of the turns after the last question)."""
    client = openai.OpenAI(base_url=f"{reasoning_server.base_url}/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model=reasoning_server.model, messages=THINKING["messages"], max_tokens=6,
                                           extra_body={k: v for k, v in THINKING.items()
                                                       if k not in ("messages", "max_tokens")})
    reply = first.choices[0].message
    assert reply.reasoning_content  # the SDK keeps vLLM's field
    question = {"role": "user", "content": "What time is it?"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}
    loop = [question, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]

    def prompt_tokens(messages: list) -> int:
        answer = client.chat.completions.create(model=reasoning_server.model, messages=messages, max_tokens=1)
        return answer.usage.prompt_tokens

    without = prompt_tokens(loop)
    with_reasoning = [loop[0], {**loop[1], "reasoning_content": "Call get_time."}, loop[2]]
    assert prompt_tokens(with_reasoning) > without
    assert prompt_tokens([loop[0], {**loop[1], "reasoning": "Call get_time."}, loop[2]]) == prompt_tokens(with_reasoning)
    assert prompt_tokens([question, reply, {"role": "user", "content": "And now?"}]) > 0
    with pytest.raises(openai.BadRequestError) as refused:
        prompt_tokens([{**question, "reasoning_content": "mine"}])
    assert refused.value.body["param"] == "messages[0].reasoning_content"
