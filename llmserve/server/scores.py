"""POST /v1/score (vLLM's score API) and POST /v1/rerank (the Jina and Cohere rerank API, as vLLM serves it, also
at /rerank and /v2/rerank): how related two texts are, by an embedding model. A score is the cosine similarity
of the two texts' embeddings (a bi-encoder's score, as vLLM gives for embedding models), each text embedded as
/v1/embeddings embeds it: tokenized, screened, rate-limited, admitted, batched by the engine and metered alike.
A text asked for twice is embedded once. A cross-encoder reranker (a sequence-classification model with one
label: ms-marco-MiniLM, bge-reranker) reads each pair whole instead, one engine request per pair joined as its
tokenizer joins two texts, and its score is the logit through sigmoid (sentence-transformers' CrossEncoder's
score; identity when the model's config says so). A generative model is a 400 naming `model`, as for
embeddings.

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

from llmserve.errors import InvalidRequestError
from llmserve.model.pooling import PoolingParams, cosine_scores, relevance_scores
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.server.embeddings import Inputs, embed, usage
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


# (model name) -> (response id, each pair's score, usage) -> the body
Answer = Callable[[str], Callable[[str, list[float], dict[str, int]], bytes]]


@router.post("/v1/score", response_model=None, responses=documented(ScoreResponse))
@router.post("/score", response_model=None, include_in_schema=False)
async def create_score(body: ScoreRequest, request: Request) -> Response:
    texts = body.scored_texts()
    pairs = body.scored_pairs(texts)

    def answer(model: str) -> Callable[[str, list[float], dict[str, int]], bytes]:
        return lambda response_id, scores, used: _JSON.encode({
            "id": response_id, "object": "list", "created": now(), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], "usage": used,
        })

    return await _scored(request, body, texts, pairs, answer, "score")


@router.post("/v1/rerank", response_model=None, responses=documented(RerankResponse))
@router.post("/rerank", response_model=None, include_in_schema=False)
@router.post("/v2/rerank", response_model=None, include_in_schema=False)
async def create_rerank(body: RerankRequest, request: Request) -> Response:
    documents = body.document_texts()
    texts = body.scored_texts()
    pairs = body.scored_pairs(texts)

    def ranked(scores: list[float]) -> list[dict]:
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[: body.top_n or len(documents)]
        return [{"index": i, "relevance_score": scores[i],
                 **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]

    def answer(model: str) -> Callable[[str, list[float], dict[str, int]], bytes]:
        return lambda response_id, scores, used: _JSON.encode({
            "id": response_id, "model": model, "results": ranked(scores), "usage": used,
        })

    return await _scored(request, body, texts, pairs, answer, "rerank")


async def _scored(request: Request, body: ScoreRequest | RerankRequest, texts: ScoredTexts,
                  pairs: list[tuple[int, int]], answer: Answer, id_prefix: str) -> Response:
    """Score each pair of `texts` with the model `body` names, then answer with what `answer(model name)` writes:
    a cross-encoder reads each pair whole, an embedding model embeds each text once."""
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    endpoint.check_generates("scores")
    classifier = endpoint.engine.input_processor.classifier
    if classifier is None:
        endpoint.engine.input_processor.check_can_embed()
    elif len(classifier.labels) != 1:
        raise InvalidRequestError(
            f"The model {endpoint.name!r} classifies into {len(classifier.labels)} labels; a score needs a "
            "cross-encoder with one (use /classify for its labels).", param="model",
        )
    inputs = Inputs(texts.items, texts.params, body.truncate_prompt_tokens, pairs if classifier is not None else None)
    write = answer(endpoint.name)

    def scored(response_id: str, outputs: Sequence[EmbeddingRequestOutput]) -> bytes:
        vectors = np.stack([output.outputs.data for output in outputs])
        scores = (cosine_scores(vectors, pairs) if classifier is None
                  else relevance_scores(vectors[:, 0], classifier.score_activation))
        return write(response_id, scores, usage(outputs))

    return await embed(request, state, endpoint, key, inputs, PoolingParams(), body.priority, scored, id_prefix)
