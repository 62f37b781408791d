"""Strict functions under `tool_choice: "auto"`: the structural tag built for each family's call format,
compiled against the tiny model's vocabulary, decoded token by token at random under its masks. Text
outside calls is free; each call the decoding opens comes out whole, parses as that family's call, and
its arguments follow the function's schema. Over HTTP: in `test_tools_and_structured_output.py`."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer

from llmserve.engine.grammar import GrammarCompiler, GrammarSpec, GrammarState, tokenizer_info
from llmserve.errors import InvalidRequestError
from llmserve.server.tool_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    RequiredToolCallParser,
    ToolParser,
    tool_parser_for,
)
from llmserve.server.tool_calls.strict import any_strict, strict_calls_tag

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}
LOOSE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def vocabulary(tiny_llama_dir):
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = tokenizer.token_to_id("<|end_of_text|>")
    return tokenizer, GrammarCompiler(tokenizer_info(tiny_llama_dir / "tokenizer.json", size, [eos])), eos


def _decode_a_call(vocabulary, parser: ToolParser, tools: list, seed: int, lead: str) -> str:
    """Text that writes `lead` (free text, then the start of a call), then tokens drawn at random among
    those the grammar allows until a call parses (or EOS)."""
    tokenizer, compiler, eos = vocabulary
    spec = GrammarSpec("structural_tag", strict_calls_tag(parser, tools, parallel_tool_calls=True))
    state = GrammarState(compiler.compile(spec), start_after=[])
    ids = tokenizer.encode(lead, add_special_tokens=False).ids
    for token in ids:
        assert state.constrains
        state.accept(token)
    rng = random.Random(seed)
    bitmask = np.zeros((1, (compiler.info.vocab_size + 31) // 32), dtype=np.int32)
    for _ in range(400):
        state.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: compiler.info.vocab_size]
        token = rng.choice(np.flatnonzero(bits).tolist())
        if token == eos:
            break
        state.accept(token)
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if _whole_calls(parser, text):
            return text
    return tokenizer.decode(ids, skip_special_tokens=False)


def _whole_calls(parser: ToolParser, text: str) -> bool:
    """Whether `text` holds a call whose arguments are complete JSON (the parser streams them as they come)."""
    try:
        return any(isinstance(json.loads(call.arguments), dict) for call in parser.parse(text)[1])
    except ValueError:
        return False


@pytest.mark.parametrize(("parser", "text", "opening"), [
    (HermesToolParser(), "Let me look.", " <tool_call>"),
    (Llama3JsonToolParser(), "", '{"name": '),  # Llama 3 calls open the reply
    (MistralToolParser(), "Sure.", "[TOOL_CALLS]"),  # an array of calls
    (MistralToolParser(calls_by_name=True), "Sure.", "[TOOL_CALLS]"),  # [TOOL_CALLS]name[ARGS]{...}
])
def test_every_call_the_decoding_opens_follows_its_schema(vocabulary, parser: ToolParser, text: str,
                                                          opening: str) -> None:
    names = set()
    for seed in range(12):
        output = _decode_a_call(vocabulary, parser, [WEATHER, TIME], seed, text + opening)
        content, calls = parser.parse(output)
        # the call's last token may carry free text after it: content then
        assert len(calls) == 1 and (content or "").startswith(text), output
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            names.add(call.name)
    assert names == {"get_weather", "get_time"}  # either tool may be called


def test_a_function_without_strict_is_still_written_as_a_call(vocabulary) -> None:
    """Among strict functions, one without `strict` gets calls with any JSON object as arguments."""
    seen = set()
    for seed in range(16):
        _, calls = HermesToolParser().parse(_decode_a_call(vocabulary, HermesToolParser(), [WEATHER, LOOSE], seed,
                                                           "<tool_call>"))
        (call,) = calls
        assert isinstance(json.loads(call.arguments), dict)
        seen.add(call.name)
    assert seen == {"get_weather", "note"}


def test_text_without_a_call_is_free(vocabulary) -> None:
    """Before any call opens, the grammar allows every token but the ones that would open one wrongly."""
    tokenizer, compiler, _ = vocabulary
    tag = strict_calls_tag(HermesToolParser(), [WEATHER], parallel_tool_calls=True)
    state = GrammarState(compiler.compile(GrammarSpec("structural_tag", tag)), start_after=[])
    for token in tokenizer.encode("The weather is fine, thanks.", add_special_tokens=False).ids:
        bitmask = np.zeros((1, (compiler.info.vocab_size + 31) // 32), dtype=np.int32)
        state.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: compiler.info.vocab_size]
        assert bits[token] and bits.sum() > 0.95 * compiler.info.vocab_size
        state.accept(token)
    assert state.constrains


def test_only_requests_with_a_strict_function_are_constrained() -> None:
    assert any_strict([WEATHER, LOOSE]) and not any_strict([LOOSE])
    tag = json.loads(strict_calls_tag(Llama3JsonToolParser(), [TIME], parallel_tool_calls=False))
    assert tag["format"]["stop_after_first"] is True  # parallel_tool_calls false: one call, then the end
    assert tag["format"]["triggers"] == ['{"name": ']


def test_a_mistral_template_decides_which_form_strict_calls_take() -> None:
    by_name = tool_parser_for(None, "{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", "MistralForCausalLM")
    array = tool_parser_for("mistral", "{{ '[TOOL_CALLS]' + calls | tojson }}", "MistralForCausalLM")
    assert isinstance(by_name, MistralToolParser) and by_name.calls_by_name and not array.calls_by_name
    tag = json.loads(strict_calls_tag(array, [WEATHER], parallel_tool_calls=False))["format"]
    assert tag["tags"][0]["content"]["json_schema"]["maxItems"] == 1


def test_a_format_without_call_triggers_is_a_400_naming_tools() -> None:
    with pytest.raises(InvalidRequestError, match="not supported for the required tool-call format") as raised:
        strict_calls_tag(RequiredToolCallParser(), [WEATHER], parallel_tool_calls=True)
    assert raised.value.param == "tools"
