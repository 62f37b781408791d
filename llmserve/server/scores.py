"""POST /v1/score (vLLM's score API) and POST /v1/rerank (the Jina and Cohere rerank API, as vLLM serves it, also
at /rerank and /v2/rerank): how related two texts are, by an embedding model. A score is the cosine similarity
of the two texts' embeddings (a bi-encoder's score, as vLLM gives for embedding models), each text embedded as
/v1/embeddings embeds it: tokenized, screened, rate-limited, admitted, batched by the engine and metered alike.
A text asked for twice is embedded once. Rerankers built as cross-encoders (a classification head over the
pair) are not served: a generative model is a 400 naming `model`, as for embeddings.

Open WebUI's external reranker and Haystack's vLLM ranker speak the rerank API; the answer lists the documents
by relevance, the highest first, `top_n` of them (every one by default)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.server.embeddings import Inputs, embed
from llmserve.server.gateway import request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import RerankRequest, ScoredTexts, ScoreRequest, now
from llmserve.server.state import get_state

router = APIRouter()

_JSON = msgspec.json.Encoder()


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankResult(BaseModel):
    index: int
    document: dict[str, str] | None = None  # {"text": ...} unless return_documents is false
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: ScoreUsage


Answer = Callable[[str, Sequence[EmbeddingRequestOutput]], bytes]  # (response id, embeddings) -> the body


@router.post("/v1/score", response_model=None, responses=documented(ScoreResponse))
@router.post("/score", response_model=None, include_in_schema=False)
async def create_score(body: ScoreRequest, request: Request) -> Response:
    firsts, seconds = body.texts()
    texts = body.scored_texts()
    pairs = [(texts.at[firsts[0] if len(firsts) == 1 else firsts[i]], texts.at[second])
             for i, second in enumerate(seconds)]

    def answer(model: str) -> Answer:
        return lambda response_id, outputs: _JSON.encode({
            "id": response_id, "object": "list", "created": now(), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(_cosines(outputs, pairs))],
            "usage": _usage(outputs),
        })

    return await _scored(request, body, texts, answer, "score")


@router.post("/v1/rerank", response_model=None, responses=documented(RerankResponse))
@router.post("/rerank", response_model=None, include_in_schema=False)
@router.post("/v2/rerank", response_model=None, include_in_schema=False)
async def create_rerank(body: RerankRequest, request: Request) -> Response:
    documents = body.document_texts()
    texts = body.scored_texts()
    pairs = [(texts.at[body.query], texts.at[document]) for document in documents]

    def ranked(outputs: Sequence[EmbeddingRequestOutput]) -> list[dict]:
        scores = _cosines(outputs, pairs)
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[: body.top_n or len(documents)]
        return [{"index": i, "relevance_score": scores[i],
                 **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]

    def answer(model: str) -> Answer:
        return lambda response_id, outputs: _JSON.encode({
            "id": response_id, "model": model, "results": ranked(outputs), "usage": _usage(outputs),
        })

    return await _scored(request, body, texts, answer, "rerank")


async def _scored(request: Request, body: ScoreRequest | RerankRequest, texts: ScoredTexts,
                  answer: Callable[[str], Answer], id_prefix: str) -> Response:
    """Embed `texts` through the model `body` names, then answer with what `answer(model name)` writes."""
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    inputs = Inputs(texts.items, texts.params, body.truncate_prompt_tokens)
    return await embed(request, state, endpoint, key, inputs, PoolingParams(), body.priority, answer(endpoint.name),
                       id_prefix)


def _cosines(outputs: Sequence[EmbeddingRequestOutput], pairs: list[tuple[int, int]]) -> list[float]:
    vectors = np.stack([output.outputs.data for output in outputs]).astype(np.float64)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return [float(unit[a] @ unit[b]) for a, b in pairs]


def _usage(outputs: Sequence[EmbeddingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
