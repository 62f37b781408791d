"""Routing by what a request asks (seed 004: "route by difficulty: small/cheap models for easy requests,
the big model for hard ones").

A content router is a model name (`auto`) whose requests go to the model whose example prompts are most
like the request's text: the text and every example are embedded by a served embedding model, each
route scores the mean cosine similarity of its `top_k` nearest examples, and the best route wins when
it scores at least `threshold` and, when the default is a route too, more than `margin` above the
default's score (a tie goes to the default; a margin trades easy requests sent to the big model for fewer hard ones sent to the
small one). Otherwise, and whenever the text cannot be embedded (no text, the
embedding model loading or failing), the request goes to the router's `default`, so a request is never
refused for its routing. The examples are embedded once, at the first request.

With `history_turns` above 1, a chat's latest user messages (a stored conversation's before its own) are each
routed, and one that goes to the default takes the chat there: a conversation that once needed the big model stays on it (and on its prefix cache). The
embeddings of recent texts are kept, so a conversation's earlier turns are not embedded again.

Torch-free: `llmserve serve` embeds with its engine, `llmserve gateway` asks a replica's /v1/embeddings.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)

Embed = Callable[[Sequence[str]], Awaitable[np.ndarray]]  # texts -> one row per text
RECENT_TEXTS = 4096  # texts whose embeddings are kept (1.5 KiB each at 384 dimensions)


class ContentRouterConfig(BaseModel):
    """A router in the models config: `routers: {auto: {embedding_model, default, routes: {model: [examples]}}}`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    embedding_model: str = Field(min_length=1)  # a served model that answers /v1/embeddings
    default: str = Field(min_length=1)  # where a request goes when no route is like it enough
    routes: dict[str, list[str]] = Field(min_length=1)  # model -> example prompts
    threshold: float = Field(default=0.1, ge=-1.0, le=1.0)  # the least cosine similarity a route must score
    top_k: int = Field(default=5, ge=1)  # a route's score: the mean of its k most similar examples
    margin: float = Field(default=0.0, ge=0.0, le=2.0)  # how far above the default's score another route must be
    # a chat's latest user messages routed: any that goes to the default takes the chat there (a conversation that
    # needed the big model stays on it, and on its prefix cache)
    history_turns: int = Field(default=1, ge=1, le=32)

    @field_validator("routes")
    @classmethod
    def _examples_given(cls, routes: dict[str, list[str]]) -> dict[str, list[str]]:
        for model, examples in routes.items():
            if not examples:
                raise ValueError(f"route {model!r} needs at least one example")
            if any(not example.strip() for example in examples):
                raise ValueError(f"route {model!r} has an empty example")
        return routes

    @model_validator(mode="after")
    def _targets(self) -> ContentRouterConfig:
        if self.embedding_model in self.routes or self.embedding_model == self.default:
            raise ValueError(f"the embedding model {self.embedding_model!r} cannot also be a route")
        return self

    def models(self) -> list[str]:
        """Every model the router names: its routes, its default, its embedding model."""
        return list(dict.fromkeys([*self.routes, self.default, self.embedding_model]))


@dataclass(frozen=True)
class RouteChoice:
    model: str
    # "matched", "below_threshold" (no route like it enough), "within_margin", "history" (an earlier turn went to
    # the default), "no_text", "unavailable"
    reason: str
    score: float | None = None  # the winning route's score


@dataclass(frozen=True)
class _Examples:
    vectors: np.ndarray  # unit rows, every route's examples
    routes: list[tuple[str, slice]]  # each route's rows


class ContentRouter:
    def __init__(self, name: str, config: ContentRouterConfig, embed: Embed) -> None:
        self.name = name
        self.config = config
        self._embed = embed
        self._examples: _Examples | None = None
        self._embedding_examples: asyncio.Lock | None = None
        self._recent: OrderedDict[bytes, np.ndarray] = OrderedDict()  # text digest -> unit vector, least recent first

    async def choose(self, texts: Sequence[str]) -> RouteChoice:
        """Where a request goes by its texts (a chat's latest user messages, the latest last): where the latest
        goes, unless an earlier one goes to the default. Never raises for a routing failure: the default takes it."""
        texts = [text for text in texts[-self.config.history_turns:] if text.strip()]
        if not texts:
            return RouteChoice(self.config.default, "no_text")
        try:
            examples = await self._embedded_examples()
            queries = await self._embedded(texts)
        except Exception as exc:  # the embedding model loading, failed or refusing: route without it
            log.warning("Router %r sends a request to %r: embedding failed: %s", self.name, self.config.default, exc)
            return RouteChoice(self.config.default, "unavailable")
        choice = self._decide(examples, queries[-1])
        if choice.model != self.config.default:
            for earlier in queries[:-1]:
                if self._decide(examples, earlier).model == self.config.default:
                    return RouteChoice(self.config.default, "history", choice.score)
        return choice

    def _decide(self, examples: _Examples, query: np.ndarray) -> RouteChoice:
        scores = self._scores(examples, query)
        best = max(scores, key=scores.__getitem__)
        if scores[best] < self.config.threshold:
            return RouteChoice(self.config.default, "below_threshold", scores[best])
        default_score = scores.get(self.config.default)
        if best != self.config.default and default_score is not None and scores[best] - default_score <= self.config.margin:
            return RouteChoice(self.config.default, "within_margin", default_score)
        return RouteChoice(best, "matched", scores[best])

    async def _embedded(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's unit vector, from the cache of recent texts (a conversation's earlier turns) or embedded now,
        the new ones in one call."""
        keys = [hashlib.blake2b(text.encode(), digest_size=16).digest() for text in texts]
        found = {key: self._recent[key] for key in keys if key in self._recent}
        missing = {key: text for key, text in zip(keys, texts, strict=True) if key not in found}
        if missing:
            found.update(zip(missing, _unit_rows(await self._embed(list(missing.values()))), strict=True))
        for key in keys:
            self._recent[key] = found[key]
            self._recent.move_to_end(key)
        while len(self._recent) > RECENT_TEXTS:
            self._recent.popitem(last=False)
        return [found[key] for key in keys]

    def _scores(self, examples: _Examples, query: np.ndarray) -> dict[str, float]:
        """Each route's score: the mean cosine similarity of its `top_k` examples nearest the query."""
        similarities = examples.vectors @ query
        return {model: _mean_of_top(similarities[rows], self.config.top_k) for model, rows in examples.routes}

    async def _embedded_examples(self) -> _Examples:
        if self._examples is not None:
            return self._examples
        if self._embedding_examples is None:
            self._embedding_examples = asyncio.Lock()
        async with self._embedding_examples:  # the first requests wait for one embedding of the examples
            if self._examples is None:
                texts = [example for examples in self.config.routes.values() for example in examples]
                vectors = _unit_rows(await self._embed(texts))
                routes, start = [], 0
                for model, route_examples in self.config.routes.items():
                    routes.append((model, slice(start, start + len(route_examples))))
                    start += len(route_examples)
                self._examples = _Examples(vectors, routes)
        return self._examples


def _unit_rows(vectors: Any) -> np.ndarray:
    rows = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def _mean_of_top(similarities: np.ndarray, k: int) -> float:
    k = min(k, len(similarities))
    return float(np.partition(similarities, len(similarities) - k)[-k:].mean())


# ---- the text a request is routed by ----


def chat_texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """A chat request's user messages, from its messages as templated (`content` a string), the latest last."""
    return [message["content"] for message in messages if message["role"] == "user"]


def prompt_texts(prompts: Sequence[str | list[int]]) -> list[str]:
    """A completion request's text prompts joined into one text; none when every prompt is token ids."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    return ["\n".join(texts)] if texts else []
