"""Tool-call parsers on realistic samples of each family's format; streamed deltas equal the parse for any split."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from llmserve.errors import InvalidRequestError
from llmserve.server.tool_calls import (
    Delta,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolParser,
    assemble,
    named_tool_call_schema,
    required_tool_calls_schema,
    tool_parser,
    tool_parser_for,
)
from llmserve.server.tool_calls.json_scanner import scan_value

Calls = list[tuple[str, str]]
Sample = tuple[str, str | None, Calls]

TRICKY_ARGS = '{"query": "a {b} \\"c\\" [d]", "note": "caf\\u00e9 日本 🙂", "nested": {"list": [1, -2.5e3, true, null, {}]}}'

HERMES_SAMPLES: list[Sample] = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        "I'll look both up.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "I'll look both up.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris"}')],
    ),
    (
        f'<tool_call>\n{{"name": "search", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
        None,
        [("search", TRICKY_ARGS)],
    ),
    ("Just an answer, with <tags> and {braces}.\n", "Just an answer, with <tags> and {braces}.\n", []),
    ("Half a marker <tool_ca and more", "Half a marker <tool_ca and more", []),
    ("ends in a partial marker <tool_c", "ends in a partial marker <tool_c", []),
    (
        '<tool_call>\nnot json at all\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        "<tool_call>\nnot json at all\n</tool_call>",
        [("f", '{"x": 1}')],
    ),
    (
        'Try: <tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
        'Try: <tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
        [],
    ),
    ('<tool_call>\n{"name": 42, "arguments": {}}</tool_call>', '<tool_call>\n{"name": 42, "arguments": {}}</tool_call>', []),
    ('<tool_call>\n{"name": "get_w', '<tool_call>\n{"name": "get_w', []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", '{"city": "Par')]),
    (
        '<tool_call>\n{"arguments": {"a": [1, {"b": "}"}]}, "name": "late_name"}\n</tool_call>',
        None,
        [("late_name", '{"a": [1, {"b": "}"}]}')],
    ),
    ('<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
    (
        '<tool_call>\n{"name": "f", "arguments": {}, "id": "x"}\n</tool_call>\n\nDone, see above.',
        "Done, see above.",
        [("f", "{}")],
    ),
    ('<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>', "}}\n</tool_call>", [("f", '{"a": ')]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>trailing', "trailing", [("f", "{}")]),
]

LLAMA_SAMPLES: list[Sample] = [
    (
        '{"name": "get_weather", "parameters": {"location": "San Francisco, CA"}}',
        None,
        [("get_weather", '{"location": "San Francisco, CA"}')],
    ),
    ('<|python_tag|>{"name": "search", "parameters": {"q": "x"}}', None, [("search", '{"q": "x"}')]),
    (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, 2]}}',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')],
    ),
    (f'{{"name": "search", "arguments": {TRICKY_ARGS}}}', None, [("search", TRICKY_ARGS)]),
    ("The weather is sunny.", "The weather is sunny.", []),
    ('{"result": 42, "name": "x"}', '{"result": 42, "name": "x"}', []),
    ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    ('\n {"name": "f", "parameters": {}}\n', None, [("f", "{}")]),
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("<|python", "<|python", []),
    ('{"name": "f", "parameters": {}}; {oops}', "{oops}", [("f", "{}")]),
    ('{"name": "f", "parameters": {"a": 1,}}', "}}", [("f", '{"a": 1,')]),
    ('{"name": "f", "parameters": {"a": 1}} and then text', "and then text", [("f", '{"a": 1}')]),
]

MISTRAL_SAMPLES: list[Sample] = [
    (
        '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]',
        None,
        [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')],
    ),
    (
        'Let me check. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]',
        "Let me check.",
        [("a", '{"x": "]"}'), ("b", "{}")],
    ),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"k": 1}, "id": "abcDEF123"}]', None, [("f", '{"k": 1}')]),
    (f'[TOOL_CALLS][{{"name": "search", "arguments": {TRICKY_ARGS}}}]', None, [("search", TRICKY_ARGS)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        'Both:[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
        "Both:",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    ),
    ("[TOOL_CALLS] nope, not a call", "[TOOL_CALLS] nope, not a call", []),
    ("An answer with [TOOL in it", "An answer with [TOOL in it", []),
    ("[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    ("[TOOL_CALLS]f[ARG]{}", "[TOOL_CALLS]f[ARG]{}", []),
    ('[TOOL_CALLS]f[ARGS]{"a": "unterminated', None, [("f", '{"a": "unterminated')]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"bad": 1}]', '{"bad": 1}]', [("a", "{}")]),
    ('[TOOL_CALLS][{"name": "a", "argu', '[TOOL_CALLS][{"name": "a", "argu', []),
]

REQUIRED_SAMPLES: list[Sample] = [
    ('[{"name": "f", "parameters": {"a": 1}}]', None, [("f", '{"a": 1}')]),
    (
        '[ {"name": "f", "parameters": {"a": "x"}} , {"name": "g", "parameters": {}} ]\n',
        None,
        [("f", '{"a": "x"}'), ("g", "{}")],
    ),
    (f'[{{"name": "s", "parameters": {TRICKY_ARGS}}}]', None, [("s", TRICKY_ARGS)]),
    ("no array here", "no array here", []),
    ('[{"name": "f", "param', '[{"name": "f", "param', []),
]

NAMED_SAMPLES: list[Sample] = [
    ('{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (TRICKY_ARGS, None, [("get_weather", TRICKY_ARGS)]),
    (' {"a": [1, 2', None, [("get_weather", '{"a": [1, 2')]),
    ("not json", "not json", []),
]

FAMILIES: list[tuple[Callable[[], ToolParser], list[Sample]]] = [
    (HermesToolParser, HERMES_SAMPLES),
    (Llama3JsonToolParser, LLAMA_SAMPLES),
    (MistralToolParser, MISTRAL_SAMPLES),
    (RequiredToolCallParser, REQUIRED_SAMPLES),
    (lambda: NamedToolCallParser("get_weather"), NAMED_SAMPLES),
]
CASES = [
    pytest.param(make, sample, id=f"{make().name}-{index}")
    for make, samples in FAMILIES
    for index, sample in enumerate(samples)
]


def _calls(result: tuple[str | None, list[Any]]) -> tuple[str | None, Calls]:
    content, calls = result
    return content, [(call.name, call.arguments) for call in calls]


def _stream(parser: ToolParser, chunks: list[str]) -> list[Delta]:
    stream = parser.stream()
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas.extend(stream.feed(chunk))
    return deltas + stream.finish()


def _splits(text: str) -> list[list[str]]:
    """Every chunking worth trying: whole, char by char, every cut in two, and random chunkings."""
    rng = random.Random(len(text))
    chunkings = [[text], list(text)]
    chunkings += [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        chunkings.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return chunkings


@pytest.mark.parametrize(("make", "sample"), CASES)
def test_parse(make: Callable[[], ToolParser], sample: Sample) -> None:
    text, content, calls = sample
    assert _calls(make().parse(text)) == (content, calls)


@pytest.mark.parametrize(("make", "sample"), CASES)
def test_streamed_deltas_equal_the_parse_for_every_split(make: Callable[[], ToolParser], sample: Sample) -> None:
    text, content, calls = sample
    for chunks in _splits(text):
        deltas = _stream(make(), chunks)
        assert _calls(assemble(deltas)) == (content, calls), chunks
        _check_delta_shapes(deltas, len(calls))


def _check_delta_shapes(deltas: list[Delta], expected_calls: int) -> None:
    opened = 0
    for delta in deltas:
        assert (delta.content is None) != (delta.tool_call is None)
        assert delta.content != ""
        call = delta.tool_call
        if call is None:
            continue
        if "id" in call:
            assert call["index"] == opened and call["id"].startswith("call_") and len(call["id"]) == 29
            assert call["type"] == "function" and call["function"]["arguments"] == ""
            assert set(call) == {"index", "id", "type", "function"} and set(call["function"]) == {"name", "arguments"}
            opened += 1
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            assert call["index"] == opened - 1 and call["function"]["arguments"]
    assert opened == expected_calls


def test_arguments_stream_as_they_are_generated() -> None:
    """Fed char by char, the call's name comes as soon as its arguments begin, then one piece per char."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    stream = HermesToolParser().stream()
    seen: list[tuple[int, Delta]] = []
    for position, ch in enumerate(text):
        seen.extend((position, delta) for delta in stream.feed(ch))
    assert stream.finish() == []
    args_start = text.index('{"city"')
    head_position, head = seen[0]
    assert head_position == args_start and head.tool_call is not None
    assert head.tool_call["function"]["name"] == "get_weather"
    pieces = [(position, delta.tool_call["function"]["arguments"]) for position, delta in seen if delta.tool_call]
    assert [piece for _, piece in pieces[1:]] == list('{"city": "Paris"}')
    assert pieces[-1][0] == text.index("}}") and len(seen) == 1 + len('{"city": "Paris"}')


def test_content_is_not_held_back_longer_than_a_marker_could_need() -> None:
    stream = HermesToolParser().stream()
    assert stream.feed("Hello <tool") == [Delta(content="Hello")]
    assert stream.feed("box> ok") == [Delta(content=" <toolbox> ok")]
    assert stream.feed(" ") == []  # trailing whitespace might precede a call
    assert stream.finish() == [Delta(content=" ")]


def test_call_ids_are_unique_and_calls_started_counts() -> None:
    stream = MistralToolParser().stream()
    deltas = stream.feed('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')
    ids = [d.tool_call["id"] for d in deltas if d.tool_call and "id" in d.tool_call]
    assert len(set(ids)) == 2 and stream.calls_started == 2


def test_openai_shape_of_a_call() -> None:
    parser = HermesToolParser(new_id=lambda: "call_fixed")
    _, [call] = parser.parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert call.to_openai() == {"id": "call_fixed", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_scan_value() -> None:
    for value in ("{}", '{"a": [1, "}", {"b": null}]}', '"\\u00e9\\""', "-0.5e+2", "true", "[[]]"):
        assert scan_value(value) == len(value)
        assert scan_value(value + ' }"x') == len(value)
    assert scan_value("01") == 1  # "0" then something else
    for broken in ('{"a" 1}', "[1,]", "{,}", '"\x01"', "tru", "-", "1.", '"\\x"', '{"a": 1', "[1 2]", " {}"):
        assert scan_value(broken) is None, broken


# -- parser choice ------------------------------------------------------------------------------


def test_tool_parser_by_name_and_unknown_name() -> None:
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    assert isinstance(tool_parser_for("mistral", "<tool_call>", "LlamaForCausalLM"), MistralToolParser)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        tool_parser_for("pythonic", None, "LlamaForCausalLM")


@pytest.mark.parametrize(
    ("template", "architecture", "expected"),
    [
        ("... <tool_call> ...", "LlamaForCausalLM", HermesToolParser),
        ("{{ '[TOOL_CALLS]' }}", "LlamaForCausalLM", MistralToolParser),
        ("{{ '<|python_tag|>' }}", "Qwen3ForCausalLM", Llama3JsonToolParser),
        ("{% if message.role == 'ipython' %}", "MistralForCausalLM", Llama3JsonToolParser),
        ("{{ messages }}", "LlamaForCausalLM", Llama3JsonToolParser),
        (None, "Qwen2ForCausalLM", HermesToolParser),
        (None, "Qwen3ForCausalLM", HermesToolParser),
        (None, "MistralForCausalLM", MistralToolParser),
    ],
)
def test_tool_parser_detection(template: str | None, architecture: str, expected: type[ToolParser]) -> None:
    assert isinstance(tool_parser_for(None, template, architecture), expected)


def test_no_parser_for_an_unknown_model() -> None:
    assert tool_parser_for(None, "{{ messages }}", "GPT2LMHeadModel") is None


# -- tool_choice required / named -----------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                "required": ["city"],
                "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_schema_accepts_calls_and_rejects_others() -> None:
    schema = required_tool_calls_schema(TOOLS)
    validator = jsonschema.Draft202012Validator(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "parameters": {}}]
    assert validator.is_valid(good)
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"unit": "celsius"}}])  # city required
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": "P", "unit": "kelvin"}}])
    assert not validator.is_valid([{"name": "other", "parameters": {}}])
    assert not validator.is_valid([{"name": "get_time", "parameters": {}, "extra": 1}])
    single = jsonschema.Draft202012Validator(required_tool_calls_schema(TOOLS, parallel_tool_calls=False))
    assert single.is_valid(good[:1]) and not single.is_valid(good)
    assert "$defs" not in TOOLS[0]["function"]["parameters"] or TOOLS[0]["function"]["parameters"]["$defs"]


def test_required_output_parses_back() -> None:
    output = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}])
    jsonschema.validate(json.loads(output), required_tool_calls_schema(TOOLS))
    assert _calls(RequiredToolCallParser().parse(output)) == (
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    )


def test_named_schema() -> None:
    schema = named_tool_call_schema(TOOLS, "get_weather")
    assert schema["required"] == ["city"] and jsonschema.Draft202012Validator(schema).is_valid({"city": "x"})
    assert named_tool_call_schema(TOOLS, "get_time") == {"type": "object", "properties": {}}
    with pytest.raises(InvalidRequestError, match="'nope', which is not among the tools"):
        named_tool_call_schema(TOOLS, "nope")


def test_schema_errors() -> None:
    with pytest.raises(InvalidRequestError, match="at least one tool"):
        required_tool_calls_schema([])
    with pytest.raises(InvalidRequestError) as info:
        required_tool_calls_schema([{"type": "function", "function": {"description": "no name"}}])
    assert info.value.param == "tools[0]"
    clash = [
        {"type": "function", "function": {"name": n, "parameters": {"$defs": {"u": {"type": t}}}}}
        for n, t in (("a", "string"), ("b", "integer"))
    ]
    with pytest.raises(InvalidRequestError, match="define \\$defs/u differently"):
        required_tool_calls_schema(clash)


def test_schemas_compile_with_xgrammar() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    for schema in (required_tool_calls_schema(TOOLS), named_tool_call_schema(TOOLS, "get_weather")):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]", ",", ";", ":",
    '"name"', '"arguments"', '"parameters"', '"f"', '"a\\"}"', "1", "-2.5", "true", " ", "\n", "text", "é🙂", "\\",
]


@pytest.mark.parametrize("make", [make for make, _ in FAMILIES])
def test_random_fragments_never_raise_and_stream_like_the_parse(make: Callable[[], ToolParser]) -> None:
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        expected = _calls(make().parse(text))
        for chunks in (list(text), *_splits(text)[-3:]):
            assert _calls(assemble(_stream(make(), chunks))) == expected, text
