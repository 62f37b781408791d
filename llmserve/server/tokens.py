"""POST /tokenize and /detokenize (vLLM's extras): the served model's tokenizer over HTTP; and the count of a chat
prompt that the APIs counting their requests' input tokens share (Anthropic's count_tokens, the Responses API's
input_tokens)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from llmserve.errors import InvalidRequestError
from llmserve.multimodal.inputs import PreparedImage
from llmserve.server import errors
from llmserve.server.gateway import request_key
from llmserve.server.media import images_placed, load_images
from llmserve.server.messages import image_urls, template_messages
from llmserve.server.openapi import documented
from llmserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    continuation_conflicts,
)
from llmserve.server.state import ModelEndpoint, get_state
from llmserve.server.templates import TemplateOptions, template_options

router = APIRouter()

_JOIN_SLICE = 16384


@router.post("/tokenize", response_model=None, responses=documented(TokenizeResponse))
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    endpoint = state.endpoint(body.model, request_key(request.state))
    if body.messages is None and body.prompt is None:
        raise InvalidRequestError("Give either 'prompt' or 'messages'.", param="prompt")
    errors.reject_unsupported(continuation_conflicts(body.continue_final_message, body.add_generation_prompt))
    urls = image_urls(body.messages) if body.messages is not None else []
    images = await load_images(state, endpoint, urls, body.mm_processor_kwargs)  # a size can decide its tokens
    options = await state.workers.run(template_options, endpoint.engine.tokenizer, state.trust_request_chat_template,
                                      body.chat_template, body.documents, body.chat_template_kwargs)
    return await state.workers.run(_tokenize, endpoint, body, images, options)


def _tokenize(endpoint: ModelEndpoint, body: TokenizeRequest, images: list[PreparedImage],
              options: TemplateOptions) -> Response:
    """On a worker thread: the tokens, and their JSON (a long prompt's is long to write too)."""
    tokenizer = endpoint.engine.tokenizer
    max_model_len = endpoint.engine.max_model_len
    if isinstance(body.prompt, list):
        batch = [tokenizer.encode(text, add_special_tokens=body.add_special_tokens) for text in body.prompt]
        counts = ",".join(str(len(ids)) for ids in batch)
        tokens = ",".join(f"[{_joined(ids)}]" for ids in batch)
        return Response(
            f'{{"count":{sum(map(len, batch))},"max_model_len":{max_model_len},"tokens":[{tokens}],'
            f'"counts":[{counts}]}}',
            media_type="application/json",
        )
    if body.messages is not None:
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        ids = tokenizer.apply_chat_template(
            images_placed(endpoint, template_messages(body.messages)), add_generation_prompt=body.add_generation_prompt,
            tools=tools, tokenize=True, continue_final_message=body.continue_final_message,
            chat_template=options.template, **options.variables,
        )
        ids = endpoint.engine.input_processor.expand_placeholders(ids, images)  # each image as the tokens it takes
    else:
        assert body.prompt is not None
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    head = f'{{"count":{len(ids)},"max_model_len":{max_model_len},"tokens":['
    return Response(head + _joined(ids) + "]}", media_type="application/json")


async def count_chat_tokens(body: dict[str, Any], request: Request, param: str) -> int:
    """The tokens of a chat prompt given as a /tokenize body (an API's count of its request's input tokens); a 400
    naming `param` for a body /tokenize refuses."""
    try:
        prompt = TokenizeRequest.model_validate(body)
    except ValidationError as exc:
        where = errors.param_path(exc.errors()[0].get("loc", ()))
        raise InvalidRequestError(f"Invalid value for '{where}': {exc.errors()[0].get('msg')}", param=param) from None
    counted = await tokenize(prompt, request)
    return json.loads(bytes(counted.body))["count"]


def _joined(ids: list[int]) -> str:
    """The ids comma-separated, a slice at a time: one C call over millions of ids (json.dumps) would
    hold the GIL, and so the event loop, for its whole length."""
    return ",".join(",".join(map(str, ids[i : i + _JOIN_SLICE])) for i in range(0, len(ids), _JOIN_SLICE))


@router.post("/detokenize", response_model=None, responses=documented(DetokenizeResponse))
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    endpoint = state.endpoint(body.model, request_key(request.state))
    return await state.workers.run(_detokenize, endpoint, body.tokens)


def _detokenize(endpoint: ModelEndpoint, tokens: list[int]) -> Response:
    vocab = endpoint.engine.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=endpoint.engine.tokenizer.decode(tokens)).model_dump())
