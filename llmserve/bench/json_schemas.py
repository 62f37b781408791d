"""Generated JSON schemas for structured-output tests and benchmarks: seeded and deterministic.

Each schema is an object with nested objects, bounded arrays, enums, required and optional fields,
string patterns and lengths, and bounded numbers. Everything is bounded (string lengths, array
sizes, depth, integer ranges) so that even a random-weight model, decoding under the schema's
grammar, finishes a document in a few hundred tokens.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("id", "name", "kind", "tags", "count", "score", "owner", "items", "meta", "label", "level", "code",
          "city", "price", "color", "size", "flag", "note", "rank", "unit")
_PATTERNS = ("^[a-z]{2,6}$", "^[A-Z][a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^x[0-9a-f]{1,4}$")
_ENUMS = (["a", "b", "c"], ["low", "mid", "high"], [1, 2, 3], ["yes", "no"], ["north", "south", "east", "west"])


def generate_schemas(count: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """`count` schemas; the same `seed` gives the same list."""
    rng = random.Random(seed)
    return [_object(rng, depth=0) for _ in range(count)]


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4 if depth == 0 else 3))
    properties = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 10)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "enum":
        return {"enum": list(rng.choice(_ENUMS))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "object":
        return _object(rng, depth + 1)
    low = rng.randint(0, 2)
    items = _value(rng, depth + 1) if rng.random() < 0.5 else {"type": "string", "maxLength": 6}
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 2)}
