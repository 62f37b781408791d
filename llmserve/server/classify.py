"""POST /classify (vLLM's classification API): each input's label probabilities by a sequence-classification
model (a sentiment or moderation classifier; a one-label cross-encoder gives its sigmoid). Inputs are texts or
token ids, run as /v1/embeddings runs them (tokenized on the worker pool, screened, rate-limited, admitted,
batched by the engine and metered alike); a model without labels is a 400 naming `model`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.model.pooling import ClassifierConfig, PoolingParams
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.server.embeddings import Inputs, embed, usage
from llmserve.server.gateway import request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import ClassificationRequest, now
from llmserve.server.state import get_state

router = APIRouter()

_JSON = msgspec.json.Encoder()


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage


@router.post("/classify", response_model=None, responses=documented(ClassificationResponse))
async def create_classification(body: ClassificationRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    endpoint.check_generates("classification")
    classifier = endpoint.engine.input_processor.check_can_classify()

    def answer(response_id: str, outputs: Sequence[EmbeddingRequestOutput]) -> bytes:
        return _JSON.encode({
            "id": response_id, "object": "list", "created": now(), "model": endpoint.name,
            "data": [_labelled(i, output.outputs.data, classifier) for i, output in enumerate(outputs)],
            "usage": {**usage(outputs), "completion_tokens": 0},
        })

    return await embed(request, state, endpoint, key, Inputs.of_input(body.inputs(), body.truncate_prompt_tokens),
                       PoolingParams(), body.priority, answer, "classify")


def _labelled(index: int, logits: np.ndarray, classifier: ClassifierConfig) -> dict:
    """An input's label probabilities and its likeliest label."""
    probs = classifier.probabilities(logits)
    labels = classifier.labels
    return {"index": index, "label": labels[int(np.argmax(probs))], "probs": probs.tolist(), "num_classes": len(labels)}
