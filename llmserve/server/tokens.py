"""POST /tokenize and /detokenize (vLLM's extras): the served model's tokenizer over HTTP."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.errors import InvalidRequestError
from llmserve.server.chat import template_messages
from llmserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from llmserve.server.state import get_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    endpoint = get_state(request).endpoint(body.model)
    tokenizer = endpoint.engine.tokenizer
    if body.messages is not None:
        messages = template_messages(body.messages)
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
        )
    elif body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise InvalidRequestError("Give either 'prompt' or 'messages'.", param="prompt")
    response = TokenizeResponse(count=len(ids), max_model_len=endpoint.engine.max_model_len, tokens=ids)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    endpoint = get_state(request).endpoint(body.model)
    vocab = endpoint.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError(f"Token ids must be in [0, {vocab}).", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=endpoint.engine.tokenizer.decode(body.tokens)).model_dump())
