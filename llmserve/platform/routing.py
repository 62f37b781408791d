"""Serving several models: names to engine handles, aliases with weighted canaries, load states, and
the YAML file that configures them.

`ModelRouter` maps a request's `model` to a concrete model and its handle (whatever the server keeps
per model, usually its engine). An alias points at one model or splits traffic between several by
weight; with a routing key (an API key id, the `user` field) one key always lands on the same model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from llmserve.config import EngineConfig
from llmserve.platform.content_routing import ContentRouterConfig
from llmserve.platform.safety import SafetyConfig

T = TypeVar("T")

Targets = list[tuple[str, float]]  # (model name, weight); weights sum to 1
DEFAULT_LOADING_RETRY_AFTER_S = 5


class ModelNotFound(KeyError):
    """No model or alias by this name (the server answers 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"The model `{self.name}` does not exist."


class ModelLoading(Exception):
    """The model is still loading (the server answers 503 with Retry-After)."""

    def __init__(self, name: str, retry_after_s: int) -> None:
        super().__init__(f"The model `{name}` is still loading; retry in {retry_after_s} s.")
        self.name = name
        self.retry_after_s = retry_after_s


class ModelFailed(Exception):
    """The model failed to load (the server answers 503)."""

    def __init__(self, name: str, error: str) -> None:
        super().__init__(f"The model `{name}` failed to load: {error}")
        self.name = name
        self.error = error


def parse_alias(spec: str) -> tuple[str, Targets]:
    """Parse `--alias`: "gpt-4o-mini=my-small" or a canary "chat=small-v1:90,small-v2:10".

    Weights are normalised to sum to 1; targets without weights share equally. A target's weight is
    what follows its last ":" when that is a number, so "llama3:8b" is a name."""
    alias, sep, target_list = spec.partition("=")
    alias = alias.strip()
    if not sep or not alias:
        raise ValueError(f"Alias {spec!r} must look like 'alias=model' or 'alias=model-a:90,model-b:10'.")
    parsed = [_parse_target(part.strip(), spec) for part in target_list.split(",")]
    weighted = [weight is not None for _, weight in parsed]
    if any(weighted) and not all(weighted):
        raise ValueError(f"Alias {spec!r}: give every target a weight, or none.")
    return alias, normalise_targets({name: 1.0 if weight is None else weight for name, weight in parsed}, spec,
                                    names=[name for name, _ in parsed])


def _parse_target(part: str, spec: str) -> tuple[str, float | None]:
    if not part:
        raise ValueError(f"Alias {spec!r} has an empty target.")
    name, sep, weight_text = part.rpartition(":")
    if not sep:
        return part, None
    if not weight_text.strip():
        raise ValueError(f"Alias {spec!r} has an empty weight in {part!r}.")
    try:
        weight = float(weight_text)
    except ValueError:
        return part, None  # a name with a colon in it, not a weight
    if not name.strip():
        raise ValueError(f"Alias {spec!r} has a weight without a model name: {part!r}.")
    return name.strip(), weight


def normalise_targets(weights: Mapping[str, float], where: str, names: Sequence[str] | None = None) -> Targets:
    """[(model, weight / total)] in the given order; `where` names the alias in error messages.
    `names` (the targets as written) catches duplicates a mapping has already merged."""
    names = list(weights) if names is None else list(names)
    if not names:
        raise ValueError(f"Alias {where!r} has no targets.")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Alias {where!r} lists {duplicates[0]!r} more than once.")
    for name, weight in weights.items():
        if not name:
            raise ValueError(f"Alias {where!r} has an empty target.")
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"Alias {where!r}: the weight of {name!r} must be a positive number, got {weight}.")
    total = sum(weights.values())
    return [(name, weights[name] / total) for name in names]


class LoadState(str, Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class _Model(Generic[T]):
    state: LoadState
    handle: T | None = None
    error: str | None = None
    retry_after_s: int = DEFAULT_LOADING_RETRY_AFTER_S


class ModelRouter(Generic[T]):
    """Served models (each with a handle of type T and a load state) and aliases over them."""

    def __init__(
        self, rng: random.Random | None = None, loading_retry_after_s: int = DEFAULT_LOADING_RETRY_AFTER_S
    ) -> None:
        self._rng = rng or random.Random()
        self._loading_retry_after_s = loading_retry_after_s
        self._models: dict[str, _Model[T]] = {}
        self._aliases: dict[str, Targets] = {}
        self._unlisted: set[str] = set()  # aliases answered but not listed (a model's path as typed)
        self._lock = threading.Lock()  # loader threads call set_ready / set_failed

    def add_model(self, name: str, handle: T) -> None:
        self._register(name, _Model(LoadState.READY, handle))

    def handle(self, name: str) -> T | None:
        """A model's handle; None while it loads or once it failed. Raises ModelNotFound for an unknown one."""
        with self._lock:
            return self._known_model(name).handle

    def remove_model(self, name: str) -> None:
        """Stop answering to `name` (a model no alias points at). Raises ModelNotFound for an unknown one."""
        with self._lock:
            self._known_model(name)
            if any(name == target for targets in self._aliases.values() for target, _ in targets):
                raise ValueError(f"An alias points at {name!r}.")
            del self._models[name]

    def add_loading(self, name: str, retry_after_s: int | None = None) -> None:
        """Register a model that is still loading; `resolve` answers ModelLoading until set_ready."""
        if retry_after_s is None:
            retry_after_s = self._loading_retry_after_s
        self._register(name, _Model(LoadState.LOADING, retry_after_s=retry_after_s))

    def set_ready(self, name: str, handle: T) -> None:
        with self._lock:
            model = self._known_model(name)
            model.state, model.handle, model.error = LoadState.READY, handle, None

    def set_failed(self, name: str, error: BaseException | str) -> None:
        with self._lock:
            model = self._known_model(name)
            model.state, model.handle, model.error = LoadState.FAILED, None, str(error)

    def add_alias(self, alias: str, targets: str | Sequence[tuple[str, float]], *, listed: bool = True) -> None:
        """Point `alias` at one model (a name) or several ((name, weight) pairs, normalised here);
        an alias not `listed` resolves but is left out of `ready_names`."""
        pairs = [(targets, 1.0)] if isinstance(targets, str) else list(targets)
        normalised = normalise_targets(dict(pairs), alias, names=[name for name, _ in pairs])
        with self._lock:
            if not alias:
                raise ValueError("An alias needs a name.")
            if alias in self._models:
                raise ValueError(f"Alias {alias!r} would shadow the model of the same name.")
            unknown = [name for name, _ in normalised if name not in self._models]
            if unknown:
                raise ValueError(f"Alias {alias!r} points at {unknown[0]!r}, which is not a served model.")
            self._aliases[alias] = normalised
            if not listed:
                self._unlisted.add(alias)

    def names(self) -> list[str]:
        """Every name a request may use: models (in the order added), then aliases."""
        with self._lock:
            return [*self._models, *self._aliases]

    def model_names(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def aliases(self) -> dict[str, Targets]:
        with self._lock:
            return {alias: list(targets) for alias, targets in self._aliases.items()}

    def default_name(self) -> str:
        """The model a request that names none goes to: the first one added."""
        with self._lock:
            if not self._models:
                raise ModelNotFound("")
            return next(iter(self._models))

    def _names_in(self, state: LoadState) -> list[str]:
        with self._lock:
            return [name for name, model in self._models.items() if model.state is state]

    def loading_names(self) -> list[str]:
        return self._names_in(LoadState.LOADING)

    def failed_names(self) -> list[str]:
        return self._names_in(LoadState.FAILED)

    def ready_handles(self) -> list[T]:
        """The handles of every ready model, in the order added."""
        with self._lock:
            return [m.handle for m in self._models.values() if m.state is LoadState.READY]  # type: ignore[misc]

    def ready_names(self) -> list[str]:
        """Names to list now: ready models, then listed aliases with a ready target."""
        ready = set(self._names_in(LoadState.READY))
        with self._lock:
            aliases = [
                a for a, targets in self._aliases.items()
                if a not in self._unlisted and any(t in ready for t, _ in targets)
            ]
        return [name for name in self.model_names() if name in ready] + aliases

    def state(self, name: str) -> LoadState:
        with self._lock:
            return self._known_model(name).state

    def resolve(self, name: str, routing_key: str | None = None) -> tuple[str, T]:
        """(the concrete model name, its handle) for a request's `model`.

        Raises ModelNotFound, ModelLoading or ModelFailed. An alias's weighted choice is stable per
        `routing_key` (random by weight without one); a chosen model that is not ready gives way to
        the alias's ready ones, by the same weights."""
        with self._lock:
            if name in self._models:
                return name, self._ready_handle(name)
            if name not in self._aliases:
                raise ModelNotFound(name)
            targets = self._aliases[name]
            point = self._rng.random() if routing_key is None else _stable_point(name, routing_key)
            chosen = _pick(targets, point)
            if self._models[chosen].state is not LoadState.READY:
                ready = [(t, w) for t, w in targets if self._models[t].state is LoadState.READY]
                if ready:
                    chosen = _pick(normalise_targets(dict(ready), name), point)
            return chosen, self._ready_handle(chosen)

    def _register(self, name: str, model: _Model[T]) -> None:
        with self._lock:
            if not name:
                raise ValueError("A model needs a name.")
            if name in self._models or name in self._aliases:
                raise ValueError(f"A model or alias named {name!r} is already registered.")
            self._models[name] = model

    def _known_model(self, name: str) -> _Model[T]:
        try:
            return self._models[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def _ready_handle(self, name: str) -> T:
        model = self._models[name]
        if model.state is LoadState.LOADING:
            raise ModelLoading(name, model.retry_after_s)
        if model.state is LoadState.FAILED:
            raise ModelFailed(name, model.error or "unknown error")
        return model.handle  # type: ignore[return-value]


def _stable_point(alias: str, routing_key: str) -> float:
    """A point in [0, 1) fixed by (alias, key) and the same in every process (unlike hash())."""
    digest = hashlib.blake2b(f"{alias}\0{routing_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _pick(targets: Targets, point: float) -> str:
    cumulative = 0.0
    for name, weight in targets:
        cumulative += weight
        if point < cumulative:
            return name
    return targets[-1][0]  # rounding left the sum a hair under 1


# ---- the YAML config ----


def _engine_options_model() -> type[BaseModel]:
    """A pydantic model of EngineConfig's fields a config may set per model (not the model path or
    the served name, which come from the model entry)."""
    hints = get_type_hints(EngineConfig)
    fields: dict[str, Any] = {
        field.name: (hints[field.name], field.default)
        for field in dataclasses.fields(EngineConfig)
        if field.name not in ("model", "served_model_name")
    }
    return create_model("EngineOptions", __config__=ConfigDict(extra="forbid"), **fields)


EngineOptions = _engine_options_model()


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    name: str = Field(min_length=1)  # the served name
    model: str = Field(min_length=1)  # a path or hub id
    engine: EngineOptions = Field(default_factory=EngineOptions)  # type: ignore[valid-type]

    def engine_config(self) -> EngineConfig:
        options = self.engine.model_dump(exclude_unset=True)  # type: ignore[attr-defined]
        return EngineConfig(model=self.model, served_model_name=self.name, **options)


class Price(BaseModel):
    """USD per million tokens. `cached_input` None: cached prompt tokens cost as `input`."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cached_input: float | None = Field(default=None, ge=0)


class Tier(BaseModel):
    """What a key's tier (`llmserve keys create --tier`) gives its requests."""

    model_config = ConfigDict(extra="forbid")

    priority: int = Field(ge=-(2**31), lt=2**31)  # with --scheduling-policy priority: lower runs first


class ModelsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] = Field(default_factory=list)  # may come from --model instead
    aliases: dict[str, str | dict[str, float]] = Field(default_factory=dict)
    prices: dict[str, Price] = Field(default_factory=dict)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    tiers: dict[str, Tier] = Field(default_factory=dict)
    routers: dict[str, ContentRouterConfig] = Field(default_factory=dict)  # routing by what a request asks

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelEntry]) -> list[ModelEntry]:
        names = [entry.name for entry in models]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"model name {duplicates[0]!r} is used more than once")
        return models

    @field_validator("aliases")
    @classmethod
    def _positive_weights(cls, aliases: dict[str, str | dict[str, float]]) -> dict[str, str | dict[str, float]]:
        for alias, targets in aliases.items():
            if isinstance(targets, dict):
                normalise_targets(targets, alias)
        return aliases

    @model_validator(mode="after")
    def _known_names(self) -> ModelsConfig:
        for router in self.routers:
            if router in self.aliases:
                raise ValueError(f"router {router!r} would shadow the alias of the same name")
        if not self.models:  # the models come from the command line; the server checks the names
            return self
        models = {entry.name for entry in self.models}
        for alias, targets in self.alias_targets().items():
            if alias in models:
                raise ValueError(f"alias {alias!r} would shadow the model of the same name")
            for target, _ in targets:
                if target not in models:
                    raise ValueError(f"alias {alias!r} points at {target!r}, which is not a model in this file")
        for name in self.prices:
            if name not in models and name not in self.aliases:
                raise ValueError(f"prices names {name!r}, which is not a model or alias in this file")
        for router, config in self.routers.items():
            if router in models:
                raise ValueError(f"router {router!r} would shadow the model of the same name")
            for target in config.models():
                if target not in models:
                    raise ValueError(f"router {router!r} names {target!r}, which is not a model in this file")
        return self

    def alias_targets(self) -> dict[str, Targets]:
        """Every alias with normalised (model, weight) targets (raises ValueError on a bad weight)."""
        return {
            alias: normalise_targets({targets: 1.0} if isinstance(targets, str) else targets, alias)
            for alias, targets in self.aliases.items()
        }


class ConfigError(ValueError):
    """A models config file that cannot be read or is invalid; the message names the file and the
    path of every bad field."""


def load_models_config(path: str | Path) -> ModelsConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"Cannot read models config {path}: {exc}") from exc
    try:
        return ModelsConfig.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise ConfigError(f"Invalid models config {path}:\n{_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"]) or "(top level)"
        lines.append(f"  {location}: {error['msg']}")
    return "\n".join(lines)
