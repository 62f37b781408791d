"""Pages of the platform's stored lists, in OpenAI's way (`limit` 1..100; `after`: the id of the previous page's
last item): the limit checked, and a page of a list read whole (a stored response's input items, a stored chat
completion's messages)."""

from __future__ import annotations

from typing import Any, Literal

from llmserve.errors import InvalidRequestError

MAX_PAGE_SIZE = 100


def check_limit(limit: object) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_SIZE:
        raise InvalidRequestError(f"limit must be between 1 and {MAX_PAGE_SIZE}, got {limit!r}", param="limit")


def page_after(items: list[dict[str, Any]], limit: int, after: str | None, order: Literal["asc", "desc"],
               unknown: str) -> tuple[list[dict[str, Any]], bool]:
    """A page of `items` (given oldest first; newest first for "desc") after the one whose id is `after`, and
    whether more follow; an InvalidRequestError saying `unknown` (naming `after`) where no item has that id."""
    check_limit(limit)
    ordered = items[::-1] if order == "desc" else items
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if item.get("id") == after), -1)
        if start < 0:
            raise InvalidRequestError(unknown, param="after")
    return ordered[start:start + limit], start + limit < len(ordered)
