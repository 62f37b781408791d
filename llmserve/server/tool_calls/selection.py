"""Which tool-call parser a model gets: an explicit name, else its chat template, else its architecture."""

from __future__ import annotations

from llmserve.server.tool_calls.base import ToolParser
from llmserve.server.tool_calls.families import (
    HERMES_START,
    MISTRAL_ARGS,
    MISTRAL_TOOL_CALLS,
    PYTHON_TAG,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (Llama3JsonToolParser, HermesToolParser, MistralToolParser)
}

# What a chat template that renders tools writes, in the order they are looked for.
_TEMPLATE_SIGNS: tuple[tuple[tuple[str, ...], str], ...] = (
    ((HERMES_START,), HermesToolParser.name),
    ((MISTRAL_TOOL_CALLS,), MistralToolParser.name),
    ((PYTHON_TAG, "ipython"), Llama3JsonToolParser.name),
)

ARCHITECTURE_PARSERS: dict[str, str] = {
    "LlamaForCausalLM": Llama3JsonToolParser.name,
    "Qwen2ForCausalLM": HermesToolParser.name,
    "Qwen2MoeForCausalLM": HermesToolParser.name,
    "Qwen3ForCausalLM": HermesToolParser.name,
    "Qwen3MoeForCausalLM": HermesToolParser.name,
    "MistralForCausalLM": MistralToolParser.name,
    "MixtralForCausalLM": MistralToolParser.name,
}


def tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the names otherwise."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return parser()


def tool_parser_for(name: str | None, chat_template: str | None, architecture: str) -> ToolParser | None:
    """An explicit `name` wins; else the format the chat template writes; else the architecture's; else None."""
    if name is None:
        found = (parser for signs, parser in _TEMPLATE_SIGNS if chat_template and any(s in chat_template for s in signs))
        name = next(found, ARCHITECTURE_PARSERS.get(architecture))
    if name is None:
        return None
    parser = tool_parser(name)
    if isinstance(parser, MistralToolParser):  # which of its two forms the template writes calls in
        parser.calls_by_name = chat_template is not None and MISTRAL_ARGS in chat_template
    return parser
