"""OpenAI request fields -> the engine's `SamplingParams` (and its disaggregation part)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from llmserve.engine.messages import KVTransferParams
from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import SamplingParams, StructuredOutputsParams
from llmserve.server.protocol import (
    KVTransferRequest,
    ResponseFormat,
    SamplingFields,
    StructuredOutputsRequest,
)

# Fields the request may leave unset, to fall back on the model's generation_config defaults.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The grammar engine behind structured output, the one `guided_decoding_backend` may name ("auto" too).
STRUCTURED_OUTPUTS_BACKEND = "xgrammar"


def engine_kv_transfer(fields: KVTransferRequest | None) -> KVTransferParams | None:
    """The request's kv_transfer_params as the engine takes them (what the prefill replica held is its own)."""
    if fields is None:
        return None
    return KVTransferParams(fields.do_remote_decode, fields.do_remote_prefill, fields.transfer_id,
                            fields.remote_host, fields.remote_port)


def to_sampling_params(
    body: SamplingFields,
    defaults: SamplingParams,
    max_tokens: int | None,
    max_tokens_param: str = "max_tokens",
    logprobs: int | None = None,
) -> SamplingParams:
    """Build and validate the engine parameters; errors name the request's own field."""
    if body.use_beam_search:  # greedy: the model's sampling defaults do not apply (a field given is refused)
        defaults = dataclasses.replace(defaults, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                       repetition_penalty=1.0)
    fields = {name: getattr(body, name) for name in _DEFAULTED if getattr(body, name) is not None}
    try:
        return dataclasses.replace(
            defaults,
            **fields,
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=body.engine_prompt_logprobs(),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs(body),
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty,
        )
    except InvalidRequestError as exc:
        if exc.param == "max_tokens":
            exc.param = max_tokens_param
        elif exc.param == "structured_outputs":
            exc.param = constraint_field(body)
        elif exc.param == "prompt_logprobs" and body.prompt_logprobs is None:
            exc.param = "echo"  # completions' echo with logprobs scores the prompt
        raise


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (its keys are token ids written as strings) with int keys."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        if not key.isascii() or not key.isdigit():
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias")
        bias[int(key)] = value
    return bias


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The output constraint the request asks for, in whichever of its fields: `response_format`,
    `structured_outputs` or a `guided_*` one. Two at once is a 400 naming the second."""
    given = _constraints(body)
    return given[0][1] if given else None


def constraint_field(body: SamplingFields) -> str | None:
    """The request field the output constraint came from (for errors about it)."""
    given = _constraints(body)
    return given[0][0] if given else None


def _constraints(body: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    _check_backend(body.guided_decoding_backend)
    given: list[tuple[str, StructuredOutputsParams]] = []
    if body.response_format is not None and body.response_format.type != "text":
        given.append(("response_format", _from_response_format(body.response_format)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    guided = {
        "guided_json": lambda v: StructuredOutputsParams(json=_schema_text(v)),
        "guided_regex": lambda v: StructuredOutputsParams(regex=v),
        "guided_choice": lambda v: StructuredOutputsParams(choice=list(v)),
        "guided_grammar": lambda v: StructuredOutputsParams(grammar=v),
    }
    for name, make in guided.items():
        value = getattr(body, name)
        if value is not None:
            given.append((name, make(value)))
    if len(given) > 1:
        first, second = given[0][0], given[1][0]
        raise InvalidRequestError(
            f"Give one output constraint: {first} and {second} were both given.", param=second
        )
    return given


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in ("auto", STRUCTURED_OUTPUTS_BACKEND):
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not available: structured output is decoded with "
            f"{STRUCTURED_OUTPUTS_BACKEND!r}.",
            param="guided_decoding_backend",
        )


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "structural_tag":
        return StructuredOutputsParams(structural_tag=json.dumps(response_format.structural_tag()))
    assert response_format.json_schema is not None  # the protocol model checks it
    return StructuredOutputsParams(json=_schema_text(response_format.json_schema.schema_))


def _from_structured_outputs(request: StructuredOutputsRequest) -> StructuredOutputsParams:
    # The protocol model has checked that exactly one kind is set.
    if request.json_ is not None:
        return StructuredOutputsParams(json=_schema_text(request.json_))
    if request.json_object:
        return StructuredOutputsParams(json_object=True)
    if request.structural_tag is not None:
        return StructuredOutputsParams(structural_tag=json.dumps(request.structural_tag))
    return StructuredOutputsParams(
        regex=request.regex, choice=list(request.choice) if request.choice is not None else None, grammar=request.grammar
    )


def _schema_text(schema: dict[str, Any]) -> str:
    # Key order is kept: it is the order the properties are generated in.
    return json.dumps(schema)
