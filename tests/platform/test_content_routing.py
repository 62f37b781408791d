"""The content router's decision (platform/content_routing.py) over an embedding whose similarities are known
exactly: each text a bag of its words over a fixed vocabulary, so a cosine similarity is a count of shared words.
The router over a real embedding model is tested through the server (tests/server/test_content_routing.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from pydantic import ValidationError

from llmserve.platform import content_routing
from llmserve.platform.content_routing import (
    ContentRouter,
    ContentRouterConfig,
    chat_texts,
    prompt_texts,
)
from llmserve.platform.routing import ModelsConfig

VOCABULARY = ["hi", "thanks", "capital", "prove", "theorem", "design", "database", "code"]


class BagOfWords:
    """An embedding: word counts over VOCABULARY; counts the texts it was asked for."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.failing = False

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if self.failing:
            raise ConnectionError("the embedding model is down")
        return np.array([[text.lower().split().count(word) for word in VOCABULARY] for text in texts], dtype=float)


def router(
    embed: BagOfWords, threshold: float = 0.5, top_k: int = 1, margin: float = 0.0, history_turns: int = 1
) -> ContentRouter:
    config = ContentRouterConfig(
        embedding_model="embedder", default="big", threshold=threshold, top_k=top_k, margin=margin,
        history_turns=history_turns,
        routes={"small": ["hi", "thanks", "capital"], "big": ["prove theorem", "design database", "code"]},
    )
    return ContentRouter("auto", config, embed)


def choose(router: ContentRouter, *texts: str):
    return asyncio.run(router.choose(texts))


def test_a_text_goes_to_the_route_of_its_nearest_example() -> None:
    auto = router(BagOfWords())
    assert choose(auto, "hi").model == "small"
    assert choose(auto, "prove the theorem").model == "big"
    easy = choose(auto, "thanks hi")
    assert (easy.model, easy.reason) == ("small", "matched")
    assert easy.score == pytest.approx(1 / np.sqrt(2))  # "thanks hi" against "thanks" (or "hi")


def test_below_the_threshold_the_default_takes_the_request() -> None:
    strict = router(BagOfWords(), threshold=0.9)
    choice = choose(strict, "thanks hi")  # 0.71 against its best route
    assert (choice.model, choice.reason) == ("big", "below_threshold")
    assert choice.score == pytest.approx(1 / np.sqrt(2))
    unrelated = choose(router(BagOfWords()), "the weather today")  # shares no word: similarity 0
    assert (unrelated.model, unrelated.reason) == ("big", "below_threshold")


def test_a_route_scores_the_mean_of_its_k_nearest_examples() -> None:
    # "hi thanks capital": 1/sqrt(3) against each small example; 0 against the big ones
    nearest = choose(router(BagOfWords(), threshold=0.0, top_k=2), "hi thanks capital")
    assert nearest.model == "small" and nearest.score == pytest.approx(1 / np.sqrt(3))
    # "prove code": 0.5 against "prove theorem", 0.71 against "code", 0 against "design database": top 2 mean 0.60
    two = choose(router(BagOfWords(), threshold=0.0, top_k=2), "prove code")
    assert two.model == "big" and two.score == pytest.approx((0.5 + 1 / np.sqrt(2)) / 2)
    every = choose(router(BagOfWords(), threshold=0.0, top_k=10), "prove code")  # k past the examples: all three
    assert every.score == pytest.approx((0.5 + 1 / np.sqrt(2)) / 3)


def test_another_route_must_beat_the_default_by_the_margin() -> None:
    # "hi hi code": 0.89 against "hi" (small), 0.45 against "code" (big)
    assert choose(router(BagOfWords(), margin=0.4), "hi hi code").model == "small"
    within = choose(router(BagOfWords(), margin=0.5), "hi hi code")
    assert (within.model, within.reason) == ("big", "within_margin")
    assert within.score == pytest.approx(1 / np.sqrt(5))
    tie = choose(router(BagOfWords()), "hi code")  # 0.71 against both routes: the default wins a tie
    assert (tie.model, tie.reason) == ("big", "within_margin")
    assert choose(router(BagOfWords(), margin=1.0), "prove code").model == "big"  # the default is never held back


def test_the_examples_are_embedded_once_for_every_request() -> None:
    embed = BagOfWords()
    auto = router(embed)

    async def many() -> list[str]:
        return [choice.model for choice in await asyncio.gather(*(auto.choose([t]) for t in ["hi", "code", "capital"]))]

    assert asyncio.run(many()) == ["small", "big", "small"]
    example_calls = [call for call in embed.calls if len(call) == 6]
    assert example_calls == [["hi", "thanks", "capital", "prove theorem", "design database", "code"]]
    assert sorted(call for call in embed.calls if len(call) == 1) == [["capital"], ["code"], ["hi"]]


def test_without_text_or_an_embedding_the_default_takes_the_request() -> None:
    embed = BagOfWords()
    auto = router(embed)
    assert (choose(auto).model, choose(auto).reason) == ("big", "no_text")
    assert choose(auto, "  \n").reason == "no_text"
    assert embed.calls == []  # nothing embedded for them
    embed.failing = True
    down = choose(auto, "hi")
    assert (down.model, down.reason, down.score) == ("big", "unavailable", None)
    embed.failing = False  # back: the examples, never embedded, are embedded now
    assert choose(auto, "hi").model == "small"


def test_the_texts_a_request_is_routed_by() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "the latest question"},
        {"role": "assistant", "content": "a prefilled start"},
    ]
    assert chat_texts(messages) == ["first question", "the latest question"]
    assert chat_texts([{"role": "system", "content": "only a system prompt"}]) == []
    assert prompt_texts(["one", [1, 2, 3], "two"]) == ["one\ntwo"]
    assert prompt_texts([[1, 2, 3]]) == []


def test_with_history_a_turn_that_went_to_the_default_keeps_the_chat_there() -> None:
    embed = BagOfWords()
    sticky = router(embed, history_turns=2)
    assert choose(sticky, "hi", "thanks").model == "small"  # both turns easy
    escalated = choose(sticky, "prove theorem", "thanks")  # the hard turn before keeps it on the default
    assert (escalated.model, escalated.reason) == ("big", "history")
    assert choose(sticky, "prove theorem", "hi", "thanks").model == "small"  # past the 2 turns looked at
    assert choose(sticky, "hi", "prove theorem").reason == "matched"  # the latest went to the default itself
    # each text embedded once: after the examples, only texts not seen before (earlier turns come from the cache)
    assert embed.calls[1:] == [["hi", "thanks"], ["prove theorem"]]
    assert choose(router(BagOfWords()), "prove theorem", "thanks").model == "small"  # history_turns 1: the latest


def test_recent_texts_are_kept_up_to_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(content_routing, "RECENT_TEXTS", 2)
    embed = BagOfWords()
    auto = router(embed)
    for text in ("hi", "code", "hi", "capital", "code"):  # "code" is the least recent when "capital" comes
        choose(auto, text)
    assert embed.calls[1:] == [["hi"], ["code"], ["capital"], ["code"]]


def test_the_config_names_models_it_serves() -> None:
    models = [{"name": name, "model": f"/models/{name}"} for name in ("small", "big", "embedder")]
    router = {"embedding_model": "embedder", "default": "big", "routes": {"small": ["hi"], "big": ["prove it"]}}
    config = ModelsConfig.model_validate({"models": models, "routers": {"auto": router}})
    assert config.routers["auto"].models() == ["small", "big", "embedder"]
    bad = {
        "unknown route": ({**router, "routes": {"tiny": ["hi"]}}, "names 'tiny', which is not a model"),
        "unknown embedder": ({**router, "embedding_model": "nope"}, "names 'nope', which is not a model"),
        "no examples": ({**router, "routes": {"small": []}}, "route 'small' needs at least one example"),
        "empty example": ({**router, "routes": {"small": [" "]}}, "route 'small' has an empty example"),
        "no routes": ({**router, "routes": {}}, "routes"),
        "embedder routed": ({**router, "default": "embedder"}, "cannot also be a route"),
        "threshold": ({**router, "threshold": 1.5}, "threshold"),
        "extra field": ({**router, "score_threshold": 0.5}, "score_threshold"),
    }
    for case, (routers, message) in bad.items():
        with pytest.raises(ValidationError, match=message):
            ModelsConfig.model_validate({"models": models, "routers": {"auto": routers}})
            pytest.fail(case)
    with pytest.raises(ValidationError, match="router 'small' would shadow the model"):
        ModelsConfig.model_validate({"models": models, "routers": {"small": router}})
    with pytest.raises(ValidationError, match="router 'auto' would shadow the alias"):
        ModelsConfig.model_validate({"aliases": {"auto": "small"}, "routers": {"auto": router}})
