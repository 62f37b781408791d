"""Which moderator answers a /v1/moderations request, and the content filter's answer: the same in the server and
the gateway (torch-free). The filter's request is rate-limited and metered as one that used no tokens, its texts
read on a worker thread."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi.responses import JSONResponse

from llmserve.platform.keys import ApiKey
from llmserve.platform.moderation import (
    CONTENT_FILTER_MODEL,
    DEFAULT_MODERATION_MODEL,
    filter_result,
    moderation_body,
    moderation_model,
)
from llmserve.platform.usage import UsageStatus
from llmserve.server.errors import APIError
from llmserve.server.gateway import Meter, Platform
from llmserve.server.protocol import random_id
from llmserve.server.workers import WorkerPool


def choose_moderator(requested: str | None, served_names: Sequence[str], platform: Platform | None) -> str:
    """The served model (or alias) that judges the texts, or CONTENT_FILTER_MODEL; a 404 naming `model` when
    the one asked for is OpenAI's and neither it nor a content filter is here."""
    has_filter = platform is not None and platform.safety is not None
    model = moderation_model(requested, served_names, has_filter)
    if model is None:
        name = requested or DEFAULT_MODERATION_MODEL
        raise APIError(
            404, f"No moderation model is served as {name!r}, and no content filter is configured: serve a "
            f"sequence-classification model under that name or alias one to it (--alias {name}=MODEL), name a "
            "served classifier in `model`, or configure safety rules.", param="model", code="model_not_found",
        )
    return model


async def moderate_by_filter(
    platform: Platform, workers: WorkerPool, key: ApiKey | None, texts: Sequence[str]
) -> JSONResponse:
    safety_filter = platform.safety
    assert safety_filter is not None
    response_id = random_id("modr")
    admission = await platform.admit(key, CONTENT_FILTER_MODEL, 0)
    meter = Meter(platform, response_id, key, CONTENT_FILTER_MODEL, admission, 0)
    status = UsageStatus.ERROR
    try:
        results = await workers.run(lambda: [filter_result(safety_filter, text) for text in texts])
        status = UsageStatus.COMPLETED
        await meter.finish_durably(status)
    finally:
        meter.finish(status)
    usage = {"prompt_tokens": 0, "total_tokens": 0}
    return JSONResponse(moderation_body(response_id, CONTENT_FILTER_MODEL, results, usage), headers=admission.headers)
