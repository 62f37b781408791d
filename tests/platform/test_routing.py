"""Model routing: alias parsing, the router (aliases, weighted canaries, load states), the YAML config."""

from __future__ import annotations

import random
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from llmserve.config import EngineConfig
from llmserve.platform.routing import (
    ConfigError,
    LoadState,
    ModelFailed,
    ModelLoading,
    ModelNotFound,
    ModelRouter,
    load_models_config,
    parse_alias,
)
from llmserve.platform.safety import ContentSafety

# ---- alias parsing ----


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("gpt-4o-mini=my-small-model", ("gpt-4o-mini", [("my-small-model", 1.0)])),
        ("chat=small-v1:90,small-v2:10", ("chat", [("small-v1", 0.9), ("small-v2", 0.1)])),
        (" chat = small-v1:3 , small-v2:1 ", ("chat", [("small-v1", 0.75), ("small-v2", 0.25)])),
        ("chat=a,b", ("chat", [("a", 0.5), ("b", 0.5)])),
        ("fast=org/model:2", ("fast", [("org/model", 1.0)])),
        ("local=llama3:8b", ("local", [("llama3:8b", 1.0)])),  # "8b" is no weight: part of the name
        ("mix=llama3:8b:1,llama3:70b:3", ("mix", [("llama3:8b", 0.25), ("llama3:70b", 0.75)])),
    ],
)
def test_parse_alias(spec: str, expected: tuple[str, list[tuple[str, float]]]) -> None:
    alias, targets = parse_alias(spec)
    assert alias == expected[0]
    assert [name for name, _ in targets] == [name for name, _ in expected[1]]
    assert [weight for _, weight in targets] == pytest.approx([weight for _, weight in expected[1]])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-equals-sign", "must look like 'alias=model'"),
        ("=small", "must look like 'alias=model'"),
        ("chat=", "has an empty target"),
        ("chat=a,,b", "has an empty target"),
        ("chat=a:0", "weight of 'a' must be a positive number, got 0.0"),
        ("chat=a:-5,b:10", "weight of 'a' must be a positive number, got -5.0"),
        ("chat=a:nan", "weight of 'a' must be a positive number, got nan"),
        ("chat=a:inf", "weight of 'a' must be a positive number, got inf"),
        ("chat=a:90,b", "give every target a weight, or none"),
        ("chat=a:1,a:2", "lists 'a' more than once"),
        ("chat=a:", "has an empty weight in 'a:'"),
        ("chat=:5", "has a weight without a model name"),
    ],
)
def test_parse_alias_rejects_malformed_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_alias(spec)


# ---- the router ----


def router_with_canary(rng: random.Random | None = None) -> ModelRouter[str]:
    router: ModelRouter[str] = ModelRouter(rng=rng)
    router.add_model("small-v1", "engine-v1")
    router.add_model("small-v2", "engine-v2")
    router.add_alias("chat", parse_alias("chat=small-v1:90,small-v2:10")[1])
    return router


def test_models_and_aliases_resolve_to_a_concrete_model_and_handle() -> None:
    router: ModelRouter[str] = ModelRouter()
    router.add_model("small", "engine-small")
    router.add_model("big", "engine-big")
    router.add_alias("gpt-4o-mini", "small")
    assert router.resolve("big") == ("big", "engine-big")
    assert router.resolve("gpt-4o-mini") == ("small", "engine-small")
    assert router.names() == ["small", "big", "gpt-4o-mini"]
    assert router.model_names() == ["small", "big"]
    assert router.aliases() == {"gpt-4o-mini": [("small", 1.0)]}


def test_an_unknown_name_is_model_not_found() -> None:
    router = router_with_canary()
    with pytest.raises(ModelNotFound) as raised:
        router.resolve("gpt-5")
    assert isinstance(raised.value, KeyError)
    assert (raised.value.name, str(raised.value)) == ("gpt-5", "The model `gpt-5` does not exist.")


@pytest.mark.parametrize(
    ("alias", "targets", "message"),
    [
        ("small-v1", "small-v2", "would shadow the model of the same name"),
        ("other", "small-v3", "points at 'small-v3', which is not a served model"),
        ("other", [("small-v1", 1.0), ("small-v3", 1.0)], "points at 'small-v3'"),
        ("other", [("small-v1", 0.0)], "must be a positive number"),
        ("", "small-v1", "An alias needs a name"),
    ],
)
def test_bad_aliases_are_rejected(alias: str, targets: str | list[tuple[str, float]], message: str) -> None:
    router = router_with_canary()
    with pytest.raises(ValueError, match=message):
        router.add_alias(alias, targets)
    assert router.names() == ["small-v1", "small-v2", "chat"]


def test_a_name_can_be_registered_once() -> None:
    router = router_with_canary()
    for name in ("small-v1", "chat"):
        with pytest.raises(ValueError, match=f"named '{name}' is already registered"):
            router.add_model(name, "engine")
        with pytest.raises(ValueError, match=f"named '{name}' is already registered"):
            router.add_loading(name)


def test_canary_weights_hold_over_many_random_draws() -> None:
    router = router_with_canary(random.Random(1234))
    counts = Counter(router.resolve("chat")[0] for _ in range(20_000))
    assert set(counts) == {"small-v1", "small-v2"}
    assert counts["small-v2"] / 20_000 == pytest.approx(0.1, abs=0.01)


def test_canary_choice_sticks_to_a_routing_key() -> None:
    first = router_with_canary(random.Random(1))
    second = router_with_canary(random.Random(2))  # a different RNG, as in another process
    keys = [f"user-{i}" for i in range(4000)]
    choices = {key: first.resolve("chat", routing_key=key)[0] for key in keys}
    for key in keys[:200]:
        assert {first.resolve("chat", routing_key=key)[0] for _ in range(5)} == {choices[key]}
        assert second.resolve("chat", routing_key=key)[0] == choices[key]
    share = sum(choice == "small-v2" for choice in choices.values()) / len(keys)
    assert share == pytest.approx(0.1, abs=0.02)


def test_a_loading_model_answers_retry_after_until_ready() -> None:
    router: ModelRouter[str] = ModelRouter(loading_retry_after_s=3)
    router.add_loading("big", retry_after_s=7)
    router.add_loading("medium")
    router.add_alias("chat", "big")
    assert router.names() == ["big", "medium", "chat"]
    assert router.state("big") is LoadState.LOADING
    for name in ("big", "chat"):
        with pytest.raises(ModelLoading) as raised:
            router.resolve(name)
        assert (raised.value.name, raised.value.retry_after_s) == ("big", 7)
    with pytest.raises(ModelLoading) as raised:
        router.resolve("medium")
    assert raised.value.retry_after_s == 3
    router.set_ready("big", "engine-big")
    assert router.state("big") is LoadState.READY
    assert router.resolve("chat") == ("big", "engine-big")


def test_a_model_that_failed_to_load_says_why() -> None:
    router: ModelRouter[str] = ModelRouter()
    router.add_loading("big")
    router.set_failed("big", RuntimeError("out of memory"))
    assert router.state("big") is LoadState.FAILED
    with pytest.raises(ModelFailed) as raised:
        router.resolve("big")
    assert (raised.value.name, raised.value.error) == ("big", "out of memory")
    with pytest.raises(ModelNotFound):
        router.set_ready("unknown", "engine")


def test_a_canary_routes_around_a_version_that_is_not_ready() -> None:
    router: ModelRouter[str] = ModelRouter(rng=random.Random(5))
    router.add_model("small-v1", "engine-v1")
    router.add_loading("small-v2")
    router.add_alias("chat", [("small-v1", 1.0), ("small-v2", 9.0)])
    assert {router.resolve("chat")[0] for _ in range(200)} == {"small-v1"}
    router.set_failed("small-v1", "bad checkpoint")
    raised: Counter[type] = Counter()
    for _ in range(200):  # nothing ready: the chosen version's own state answers
        with pytest.raises((ModelLoading, ModelFailed)) as error:
            router.resolve("chat")
        raised[type(error.value)] += 1
    assert set(raised) == {ModelLoading, ModelFailed} and raised[ModelLoading] > raised[ModelFailed]
    router.set_ready("small-v2", "engine-v2")
    assert {router.resolve("chat", routing_key=f"k{i}")[0] for i in range(50)} == {"small-v2"}


# ---- the YAML config ----

VALID_CONFIG = r"""
models:
  - name: small            # served name
    model: /path/or/hub-id
    engine: {max_num_seqs: 64, dtype: bfloat16}
  - name: small-v2
    model: org/small-v2
aliases:
  gpt-4o-mini: small
  chat: {small: 90, small-v2: 10}
prices:
  small: {input: 0.15, cached_input: 0.075, output: 0.6}
  chat: {input: 0.2, output: 0.8}
safety:
  filter: null
  words: [badword]
  regexes: ['\bsecret-\d+\b']
  holdback_chars: 32
tiers:
  gold: {priority: -10}
  free: {priority: 10}
"""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_valid_config_loads(tmp_path: Path) -> None:
    config = load_models_config(write_config(tmp_path, VALID_CONFIG))
    assert [(m.name, m.model) for m in config.models] == [("small", "/path/or/hub-id"), ("small-v2", "org/small-v2")]
    engine = config.models[0].engine_config()
    assert engine == EngineConfig(model="/path/or/hub-id", served_model_name="small", max_num_seqs=64, dtype="bfloat16")
    assert config.models[1].engine_config() == EngineConfig(model="org/small-v2", served_model_name="small-v2")
    assert config.alias_targets() == {"gpt-4o-mini": [("small", 1.0)], "chat": [("small", 0.9), ("small-v2", 0.1)]}
    assert (config.prices["small"].cached_input, config.prices["chat"].cached_input) == (0.075, None)
    assert {name: tier.priority for name, tier in config.tiers.items()} == {"gold": -10, "free": 10}
    safety = ContentSafety.from_config(config.safety)
    assert safety is not None
    assert safety.output_guard("r").feed("my secret-12 is", finished=True).verdict.rule == "regexes[0]"


def test_a_config_feeds_the_router(tmp_path: Path) -> None:
    config = load_models_config(write_config(tmp_path, VALID_CONFIG))
    router: ModelRouter[EngineConfig] = ModelRouter(rng=random.Random(0))
    for entry in config.models:
        router.add_model(entry.name, entry.engine_config())
    for alias, targets in config.alias_targets().items():
        router.add_alias(alias, targets)
    assert router.names() == ["small", "small-v2", "gpt-4o-mini", "chat"]
    assert router.resolve("gpt-4o-mini")[1].max_num_seqs == 64


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: [{name: a, model: x}]\nmodel_list: []\n", "model_list: Extra inputs are not permitted"),
        ("models: [{name: a, model: x, engine: {colour: red}}]\n", "models.0.engine.colour: Extra inputs"),
        ("models: [{name: a, model: x, engine: {max_num_seqs: lots}}]\n", "models.0.engine.max_num_seqs: Input should be a valid integer"),
        ("models: [{name: a}]\n", "models.0.model: Field required"),
        ("models: [{name: '', model: x}]\n", "models.0.name: String should have at least 1 character"),
        ("models: [{name: a, model: x}]\naliases: {c: {a: 0}}\n", "the weight of 'a' must be a positive number, got 0.0"),
        ("models: [{name: a, model: x}]\naliases: {c: {a: -3}}\n", "the weight of 'a' must be a positive number, got -3.0"),
        ("models: [{name: a, model: x}]\naliases: {c: {a: many}}\n", "aliases.c.dict\\[str,float\\].a: Input should be a valid number"),
        ("models: [{name: a, model: x}]\naliases: {c: b}\n", "alias 'c' points at 'b', which is not a model in this file"),
        ("models: [{name: a, model: x}]\naliases: {a: a}\n", "alias 'a' would shadow the model"),
        ("models: [{name: a, model: x}, {name: a, model: y}]\n", "model name 'a' is used more than once"),
        ("models: [{name: a, model: x}]\nprices: {b: {input: 1, output: 2}}\n", "prices names 'b'"),
        ("models: [{name: a, model: x}]\nprices: {a: {input: -1, output: 2}}\n", "prices.a.input: Input should be greater than or equal to 0"),
        ("models: [{name: a, model: x}]\nsafety: {regexes: ['(']}\n", "safety.regexes: Value error, Safety rule regexes\\[0\\]"),
        ("models: [{name: a, model: x}]\nsafety: {word: [x]}\n", "safety.word: Extra inputs are not permitted"),
        ("tiers: {gold: {priority: high}}\n", "tiers.gold.priority: Input should be a valid integer"),
        ("tiers: {gold: {priority: 1, rpm: 5}}\n", "tiers.gold.rpm: Extra inputs are not permitted"),
        ("models: [{name: a, model: x\n", "Cannot read models config"),
        ("- just\n- a list\n", "Input should be a valid dictionary"),
    ],
)
def test_an_invalid_config_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as raised:
        load_models_config(path)
    assert str(path) in str(raised.value)


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Cannot read models config .*nope.yaml"):
        load_models_config(tmp_path / "nope.yaml")
