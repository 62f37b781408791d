"""Structured output and chat template variables, request side: every way a client asks for a
constraint (OpenAI's response_format, vLLM's structured_outputs and guided_* fields) becomes the one
`SamplingParams.structured_outputs`; malformed or conflicting asks are 400s naming the field; the
request's chat_template_kwargs reach the chat template."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import SamplingParams, StructuredOutputsParams
from llmserve.server.app import build_app
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.server.sampling import to_sampling_params
from tests.server.conftest import (
    MAX_NUM_BATCHED_TOKENS,
    MODEL_NAME,
    NUM_KV_BLOCKS,
    start_server,
    tiny_engine_running,
)

MESSAGES = [{"role": "user", "content": "Name a colour."}]
# Key order on purpose: the schema text keeps it (it is the order properties are generated in).
SCHEMA = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["z"]}


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Once", **fields})


def _constraint(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutputsParams | None:
    return to_sampling_params(body, SamplingParams(), 16).structured_outputs


# ---- request body -> SamplingParams.structured_outputs -----------------------------------------------


@pytest.mark.parametrize("make", [_chat, _completion])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True, "description": "d"}}},
            StructuredOutputsParams(json=json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, StructuredOutputsParams(choice=["red", "blue"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"guided_regex": "\\d{3}"}, StructuredOutputsParams(regex="\\d{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutputsParams(grammar='root ::= "b"')),
        ({"guided_choice": ["yes"], "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(choice=["yes"])),
        ({"guided_decoding_backend": "auto"}, None),
    ],
)
def test_every_way_to_ask_maps_to_one_constraint(make, fields, expected):
    assert _constraint(make(**fields)) == expected


def test_the_schema_text_keeps_the_key_order():
    constraint = _constraint(_chat(guided_json=SCHEMA))
    assert constraint is not None and constraint.json is not None
    assert list(json.loads(constraint.json)["properties"]) == ["z", "a"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_conflicting_asks_name_the_field(fields, param):
    for body in (_chat(**fields), _completion(**fields)):
        with pytest.raises(InvalidRequestError) as info:
            to_sampling_params(body, SamplingParams(), 16)
        assert info.value.param == param


# ---- over HTTP: shape errors and the chat template's variables -----------------------------------

THINKING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory) -> Iterator[httpx.Client]:
    """A live server on the tiny model, its chat template reading `enable_thinking` as Qwen3's does."""
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    with tiny_engine_running(model_dir, NUM_KV_BLOCKS, MAX_NUM_BATCHED_TOKENS) as engine:
        server, thread, base_url, _ = start_server(build_app(engine, MODEL_NAME))
        try:
            with httpx.Client(base_url=base_url, timeout=60) as client:
                yield client
        finally:
            server.should_exit = True
            thread.join(timeout=30)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _post(http: httpx.Client, path: str, fields: dict) -> httpx.Response:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "Once"}
    return http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **base, **fields})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_value"),
        ({"response_format": {"type": "json_object", "json_schema": {"name": "n", "schema": {}}}}, "response_format",
         "invalid_value"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "missing_required_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
         "response_format.json_schema.name", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": "yes"}}},
         "response_format.json_schema.strict", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "x": 1}}},
         "response_format.json_schema.x", "unknown_parameter"),
        ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_value"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "invalid_value"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_value"),
        ({"guided_json": "[]"}, "guided_json", "invalid_value"),
        ({"guided_choice": []}, "guided_choice", "invalid_value"),
        ({"guided_regex": 5}, "guided_regex", "invalid_value"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", None),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", None),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", None),
    ],
)
def test_malformed_or_conflicting_asks_are_400s_naming_the_field(http, path, fields, param, code):
    response = _post(http, path, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


def test_chat_template_kwargs_reach_the_template(http):
    plain = _post(http, CHAT, {})
    thinking_off = _post(http, CHAT, {"chat_template_kwargs": {"enable_thinking": False}})
    thinking_on = _post(http, CHAT, {"chat_template_kwargs": {"enable_thinking": True}})
    assert plain.status_code == thinking_off.status_code == thinking_on.status_code == 200, thinking_off.text
    tokens = {name: r.json()["usage"]["prompt_tokens"] for name, r in
              (("plain", plain), ("off", thinking_off), ("on", thinking_on))}
    # "<think>\n\n</think>\n\n" is in the prompt only when thinking is turned off.
    assert tokens["plain"] == tokens["on"] < tokens["off"]


def test_reasoning_effort_reaches_a_template_that_reads_it(http):
    plain, low = _post(http, CHAT, {}), _post(http, CHAT, {"reasoning_effort": "low"})
    assert plain.status_code == low.status_code == 200, low.text
    # "<|im_start|>system\nReasoning: low<|im_end|>\n" leads the prompt only when it is given.
    assert low.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    same = _post(http, CHAT, {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert same.json()["usage"]["prompt_tokens"] == low.json()["usage"]["prompt_tokens"]
    for fields in ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                   {"reasoning_effort": "extreme"}):
        response = _post(http, CHAT, fields)
        assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tokenize", "tools", "self"])
def test_chat_template_kwargs_cannot_set_what_the_request_sets(http, name):
    response = _post(http, CHAT, {"chat_template_kwargs": {name: True}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_completions_take_no_chat_template_kwargs(http):
    response = _post(http, COMPLETIONS, {"chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_parameter"
