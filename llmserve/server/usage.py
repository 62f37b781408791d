"""GET /v1/usage: tokens, requests and cost over a period (the seed's /api/usage), grouped by model, key
or day. A key sees its own usage; an admin key (or anyone in local mode, with no keys) sees all. A key
with a token quota also sees it as `quota`: tokens, period, used, remaining and when it renews."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from llmserve.platform.usage import query_usage
from llmserve.server.errors import APIError
from llmserve.server.gateway import platform_of, request_key

router = APIRouter()


def _parse_time(value: str | None, param: str) -> datetime | None:
    """A Unix timestamp or an ISO 8601 date/time (UTC unless it says otherwise)."""
    if value is None or value == "":
        return None
    try:
        moment = datetime.fromtimestamp(float(value), tz=timezone.utc)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise APIError(
                400, f"Invalid value for '{param}': give a Unix timestamp or an ISO 8601 date.", param=param
            ) from None
    except (OverflowError, OSError):
        raise APIError(400, f"Invalid value for '{param}': out of range.", param=param) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


@router.get("/v1/usage")
async def get_usage(
    request: Request,
    start: str | None = None,
    end: str | None = None,
    group_by: Literal["model", "key", "day"] | None = Query(None),
) -> JSONResponse:
    platform = platform_of(request)
    if platform is None or platform.usage is None or platform.database is None:
        raise APIError(404, "Usage metering is not enabled on this server.", code="not_enabled")
    start_at, end_at = _parse_time(start, "start"), _parse_time(end, "end")
    if start_at is not None and end_at is not None and end_at < start_at:
        raise APIError(400, "'end' must not be before 'start'.", param="end")
    key = request_key(request.state)
    key_id = None if key is None or key.is_admin else key.id
    await asyncio.to_thread(platform.usage.flush)  # include what is still buffered
    report = await asyncio.to_thread(
        query_usage,
        platform.database,
        start=start_at,
        end=end_at,
        group_by=group_by,
        key_id=key_id,
        prices=platform.prices,
    )
    if key is not None and platform.quotas is not None and key.token_quota is not None:
        quota = await platform.quotas.state(key)
        report["quota"] = quota.as_dict() if quota is not None else None
    return JSONResponse(report)
