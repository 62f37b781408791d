"""OpenAI's metadata on stored objects (conversations, batches, chat completions): at most 16 pairs of strings, keys
of at most 64 characters, values of at most 512."""

from __future__ import annotations

from collections.abc import Mapping

from llmserve.errors import InvalidRequestError

MAX_PAIRS = 16
MAX_KEY_LENGTH = 64
MAX_VALUE_LENGTH = 512


def checked_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """`metadata` as stored (None: none); an InvalidRequestError naming `metadata` past OpenAI's bounds."""
    pairs = dict(metadata or {})
    if len(pairs) > MAX_PAIRS or not all(
        isinstance(key, str) and isinstance(value, str) and len(key) <= MAX_KEY_LENGTH
        and len(value) <= MAX_VALUE_LENGTH for key, value in pairs.items()
    ):
        raise InvalidRequestError(f"metadata holds at most {MAX_PAIRS} pairs of strings (keys up to {MAX_KEY_LENGTH} "
                                  f"characters, values up to {MAX_VALUE_LENGTH}).", param="metadata")
    return pairs
