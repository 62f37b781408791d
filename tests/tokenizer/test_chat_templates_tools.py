"""Chat templates with tools: the built-in ChatML/Hermes template, and tool-result turns round-tripping through
the templates of every supported family (assistant calls parse back with that family's parser)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.errors import InvalidRequestError
from llmserve.model.builtin import CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from llmserve.server.tool_calls import HermesToolParser, Llama3JsonToolParser, MistralToolParser, ToolParser
from llmserve.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.test_tokenizer import CONVERSATIONS

# The built-in template before it learnt tools: conversations without tools must render exactly as it did.
PREVIOUS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown message role: ' + message['role']) }}"
    "{% endif %}"
    "{% set content = message['content'] if message['content'] is string else '' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A minimal template in Llama 3.1's JSON tool style (tools in the system turn, results as ipython turns).
LLAMA31_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n"
    "Respond with a JSON function call {\"name\": function name, \"parameters\": arguments}. Functions:' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ['tool', 'ipython'] %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% elif message['tool_calls'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '{\"name\": ' + (call['function']['name'] | tojson) + ', \"parameters\": '"
    " + (call['function']['arguments'] | tojson) + '}' }}"
    "{% if not loop.last %}{{ '; ' }}{% endif %}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# A minimal template in Mistral's style: [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] with ids,
# [TOOL_RESULTS] holding the call id and the content.
MISTRAL_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{% if tools and loop.index0 == (messages | map(attribute='role') | list).index('user') %}"
    "{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}"
    "{% endif %}"
    "{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '[TOOL_CALLS][' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + ', \"id\": ' + (call['id'] | tojson) + '}' }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}"
    "{% endfor %}"
    "{{ ']' + eos_token }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '[TOOL_RESULTS]' + ({'call_id': message['tool_call_id'], 'content': message['content']} | tojson)"
    " + '[/TOOL_RESULTS]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
]

CALL_ARGUMENTS = [
    '{"city": "Zürich", "unit": "celsius"}',
    '{"query": "a {b} \\"c\\" [d] 日本 🙂", "filters": {"year": [2024, 2025], "exact": true}}',
]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Zürich, and search for news?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a1", "type": "function", "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS[0]}},
            {"id": "call_b2", "type": "function", "function": {"name": "search", "arguments": CALL_ARGUMENTS[1]}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_b2", "content": "No news today."},
]

NO_TOOL_CONVERSATIONS: list[list[dict[str, Any]]] = [
    *CONVERSATIONS,
    [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "parts"}]}],
]


def _tokenizer(model_dir: Path, template: str) -> Tokenizer:
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["eos_token"] = "</s>" if template is MISTRAL_STYLE_TEMPLATE else config["eos_token"]
    return Tokenizer(BackendTokenizer.from_file(str(model_dir / "tokenizer.json")), config, template)


@pytest.fixture(scope="module")
def builtin(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


# -- the built-in template --------------------------------------------------------------------


@pytest.mark.parametrize("messages", NO_TOOL_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template", [CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE], ids=["llama", "qwen3"])
def test_without_tools_the_text_is_unchanged(
    tiny_llama_dir: Path, messages: list[dict[str, Any]], add_generation_prompt: bool, template: str
) -> None:
    before = _tokenizer(tiny_llama_dir, PREVIOUS_CHAT_TEMPLATE).apply_chat_template(messages, add_generation_prompt)
    now = _tokenizer(tiny_llama_dir, template)
    assert now.apply_chat_template(messages, add_generation_prompt) == before
    assert now.apply_chat_template(messages, add_generation_prompt, tools=[]) == before


def test_builtin_template_renders_tools_in_the_hermes_format(builtin: Tokenizer) -> None:
    text = builtin.apply_chat_template(CONVERSATION, add_generation_prompt=True, tools=TOOLS)
    tool_lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    assert text.startswith(
        "<|begin_of_text|><|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
    )
    assert f"<tools>\n{tool_lines}\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    calls = [json.loads(arguments) for arguments in CALL_ARGUMENTS]
    assert text.endswith(
        "<|im_start|>user\nWeather in Zürich, and search for news?<|im_end|>\n"
        "<|im_start|>assistant\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(calls[0], ensure_ascii=False)}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "search", "arguments": {json.dumps(calls[1], ensure_ascii=False)}}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>\n'
        "<tool_response>\nNo news today.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_builtin_template_with_tools_and_no_system_message(builtin: Tokenizer) -> None:
    text = builtin.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS[1:])
    assert text.startswith("<|begin_of_text|><|im_start|>system\n# Tools\n\n")
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_builtin_template_matches_transformers(tiny_llama_dir: Path, builtin: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    as_dicts = copy.deepcopy(CONVERSATION)
    for call in as_dicts[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = hf.apply_chat_template(as_dicts, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert builtin.apply_chat_template(CONVERSATION, tools=TOOLS) == expected


def test_qwen3_template_thinking(tiny_qwen3_dir: Path) -> None:
    qwen = Tokenizer.from_pretrained(tiny_qwen3_dir)
    assert qwen.chat_template == QWEN3_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "2+2?"}]
    assert qwen.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen.apply_chat_template(messages, enable_thinking=True).endswith("<|im_start|>assistant\n")
    # As Qwen3's own template: an answer's reasoning is dropped once a later question follows it, and kept in the
    # turns after the last question (a tool loop's), from `reasoning_content` or from its content's think block.
    answered = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
    history = [*messages, answered, {"role": "user", "content": "3+3?"}]
    assert "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?" in qwen.apply_chat_template(history)
    kept = "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    assert qwen.apply_chat_template([*messages, answered], add_generation_prompt=False).endswith(kept)
    separate = {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    assert qwen.apply_chat_template([*messages, separate], add_generation_prompt=False).endswith(kept)


def test_tool_call_arguments_must_be_json(builtin: Tokenizer) -> None:
    messages = copy.deepcopy(CONVERSATION)
    messages[2]["tool_calls"][1]["function"]["arguments"] = '{"query": '
    with pytest.raises(InvalidRequestError, match="not valid JSON") as info:
        builtin.apply_chat_template(messages, tools=TOOLS)
    assert info.value.param == "messages[2].tool_calls[1].function.arguments"


def test_messages_are_not_modified(builtin: Tokenizer) -> None:
    messages = copy.deepcopy(CONVERSATION)
    builtin.apply_chat_template(messages, tools=TOOLS)
    assert messages == CONVERSATION


# -- round trip through every family's template -------------------------------------------------

FAMILIES: list[tuple[str, str | None, str, type[ToolParser]]] = [
    # (id, template (None: the checkpoint's own), end of the assistant turn, parser)
    ("builtin-llama", None, "<|im_end|>\n", HermesToolParser),
    ("builtin-qwen3", None, "<|im_end|>\n", HermesToolParser),
    ("llama31-style", LLAMA31_STYLE_TEMPLATE, "<|eot_id|>", Llama3JsonToolParser),
    ("mistral-style", MISTRAL_STYLE_TEMPLATE, "</s>", MistralToolParser),
]


@pytest.mark.parametrize(("family", "template", "turn_end", "parser"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_tool_turns_round_trip(
    tiny_llama_dir: Path,
    tiny_qwen3_dir: Path,
    family: str,
    template: str | None,
    turn_end: str,
    parser: type[ToolParser],
) -> None:
    model_dir = tiny_qwen3_dir if family == "builtin-qwen3" else tiny_llama_dir
    tokenizer = Tokenizer.from_pretrained(model_dir) if template is None else _tokenizer(model_dir, template)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tools=TOOLS)
    with_call = tokenizer.apply_chat_template(CONVERSATION[:3], add_generation_prompt=False, tools=TOOLS)
    assert with_call.startswith(prompt) and with_call.endswith(turn_end)
    assistant_turn = with_call[len(prompt) : -len(turn_end)]

    content, calls = parser().parse(assistant_turn)
    assert content is None
    assert [call.name for call in calls] == ["get_weather", "search"]
    assert [json.loads(call.arguments) for call in calls] == [json.loads(a) for a in CALL_ARGUMENTS]

    full = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tools=TOOLS)
    assert full.startswith(with_call)
    results = full[len(with_call) :]
    assert '{"temperature": 21, "sky": "clear"}' in results or '{\\"temperature\\": 21' in results
    assert "No news today." in results
    if family == "mistral-style":
        assert '"call_id": "call_a1"' in results and '"call_id": "call_b2"' in results
