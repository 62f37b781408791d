"""POST /v1/moderations (OpenAI's): whether each text is harmful and in which categories, judged by a served
sequence-classification model (a moderation classifier, run as /classify runs one: tokenized on the worker pool,
rate-limited, admitted, batched by the engine and metered) or by the content filter's rules
(platform/moderation.py says which answers a request). The texts are what is judged: the safety screen does not
refuse them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.platform.moderation import CONTENT_FILTER_MODEL, classifier_result, moderation_body
from llmserve.server.embeddings import Inputs, embed, usage
from llmserve.server.gateway import request_key
from llmserve.server.moderators import choose_moderator, moderate_by_filter
from llmserve.server.openapi import documented
from llmserve.server.protocol import ModerationRequest
from llmserve.server.state import get_state

router = APIRouter()

_JSON = msgspec.json.Encoder()


class ModerationResult(BaseModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[Literal["text"]]]


class ModerationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ModerationResponse(BaseModel):
    id: str
    model: str
    results: list[ModerationResult]
    usage: ModerationUsage


@router.post("/v1/moderations", response_model=None, responses=documented(ModerationResponse))
async def create_moderation(body: ModerationRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    texts = body.texts()
    platform = state.platform
    model = choose_moderator(body.model, state.router.names(), platform)
    if model == CONTENT_FILTER_MODEL:
        assert platform is not None
        return await moderate_by_filter(platform, state.workers, key, texts)
    endpoint = state.endpoint(model, key, routing_key=key.id if key is not None else None)
    endpoint.check_generates("moderations")
    classifier = endpoint.engine.input_processor.check_can_classify()

    def answer(response_id: str, outputs: Sequence[EmbeddingRequestOutput]) -> bytes:
        results = [classifier_result(classifier.labels, classifier.probabilities(output.outputs.data).tolist())
                   for output in outputs]
        return _JSON.encode(moderation_body(response_id, endpoint.name, results, usage(outputs)))

    return await embed(request, state, endpoint, key, Inputs.of_input(texts, None), PoolingParams(), body.priority, answer,
                       "modr", screen=False)
