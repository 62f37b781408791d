"""Embeddings from hidden states: how a sequence's last-layer hidden states become one vector.

The pooling (mean over the tokens, the first [CLS] token, or the last token) and whether the vector
is L2-normalised come from the model's sentence-transformers layout when it has one (`modules.json`,
`1_Pooling/config.json`, `2_Normalize`, and `sentence_bert_config.json`'s `max_seq_length`), and may
be overridden by the engine's configuration; a request may ask for fewer `dimensions` (the vector
truncated, then normalised again: Matryoshka-style models are trained for it).

A sequence-classification model (a cross-encoder reranker, a text classifier) pools its first token and
its head turns that into label logits, which are its requests' vectors; `ClassifierConfig` says what the
labels are called and how one logit becomes a relevance score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import torch

_ST_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_MODULE = "sentence_transformers.models."
_ST_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolingParams:
    """Per request (vLLM's name): the embedding's length; None: the model's whole hidden size."""

    dimensions: int | None = None
    # a text pair's (a cross-encoder's input): where its second text starts, token type 1 from there on
    second_text_start: int | None = None

    def validate(self, hidden_size: int) -> None:
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= hidden_size):
            raise InvalidRequestError(
                f"dimensions must be an integer in [1, {hidden_size}] for this model, got {dims!r}.",
                param="dimensions",
            )


@dataclass(frozen=True)
class PoolerConfig:
    pooling: str  # one of llmserve.config.POOLING_TYPES
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' limit on the tokens it embeds


@dataclass(frozen=True)
class ClassifierConfig:
    labels: tuple[str, ...]  # by logit index
    # how a one-label logit becomes a score (sentence-transformers' CrossEncoder's activation): sigmoid or identity
    score_activation: str = "sigmoid"
    # config.json's problem_type "multi_label_classification" (a toxicity classifier's labels are not exclusive):
    # each label's probability is its own sigmoid, as transformers' text-classification pipeline gives it
    multi_label: bool = False

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        return label_probabilities(logits, self.multi_label)


_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def classifier_config(raw: dict) -> ClassifierConfig:
    """A classification model's labels (config.json's id2label) and score activation: what sentence-transformers
    saved with the model (`sentence_transformers.activation_fn`, or its older key), else sigmoid."""
    id2label = raw.get("id2label") or {str(i): f"LABEL_{i}" for i in range(int(raw.get("num_labels", 2)))}
    try:
        labels = tuple(str(id2label[str(i)]) for i in range(len(id2label)))
    except KeyError as exc:
        raise ModelLoadError(f"config.json's id2label does not number its labels 0 to {len(id2label) - 1}.") from exc
    multi_label = raw.get("problem_type") == "multi_label_classification"
    saved = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function")
    if saved is None:
        return ClassifierConfig(labels, multi_label=multi_label)
    name = str(saved).rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"The cross-encoder's activation {saved!r} is not supported (Sigmoid or Identity).")
    return ClassifierConfig(labels, _ACTIVATIONS[name], multi_label)


def pooler_config(
    config: EngineConfig, model_dir: Path, is_encoder: bool, is_classifier: bool = False
) -> PoolerConfig | None:
    """How the engine embeds (the checkpoint's layout, overridden by the configuration); None when
    it does not (a decoder without the layout, unless the task is embed). A classifier pools its first
    token (an encoder's) or its last (a decoder's) for its head."""
    if is_classifier:
        if config.task not in ("auto", "classify"):
            raise ModelLoadError(f"A sequence-classification model cannot {config.task}: serve it with --task "
                                 "classify (or auto).")
        if config.pooling is not None:
            raise ModelLoadError("--pooling does not apply to a sequence-classification model: its head reads "
                                 "the first token.")
        return PoolerConfig("cls" if is_encoder else "last", normalize=False)
    if config.task == "classify":
        raise ModelLoadError("--task classify needs a sequence-classification model (an architecture named "
                             "*ForSequenceClassification).")
    layout = read_sentence_transformers_layout(model_dir)
    if config.task == "generate" or (config.task == "auto" and layout is None and not is_encoder):
        if is_encoder:
            raise ModelLoadError("An encoder model cannot generate text: serve it with --task embed (or auto).")
        return None
    default = PoolerConfig("cls" if is_encoder else "last", normalize=True)
    base = layout or default
    return PoolerConfig(
        config.pooling or base.pooling, normalize=config.normalize and base.normalize, max_seq_length=base.max_seq_length
    )


def read_sentence_transformers_layout(model_dir: Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares; None when it has no modules.json."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {m["type"].removeprefix(_ST_MODULE): m.get("path", "") for m in modules}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{modules_file} is not a sentence-transformers module list: {exc}") from exc
    unsupported = sorted(set(kinds) - set(_ST_SUPPORTED_MODULES))
    if unsupported:
        raise ModelLoadError(f"sentence-transformers modules {', '.join(unsupported)} are not supported.")
    pooling = "cls"  # a Transformer alone: its first token, as sentence-transformers' default CLS models
    if "Pooling" in kinds:
        pooling = _pooling_mode(model_dir / kinds["Pooling"] / "config.json")
    return PoolerConfig(pooling, normalize="Normalize" in kinds, max_seq_length=_max_seq_length(model_dir))


def _pooling_mode(path: Path) -> str:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read the pooling configuration {path}: {exc}") from exc
    modes = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ModelLoadError(f"{path}: pooling {modes} is not supported (one of mean, cls or last token).")
    return _ST_POOLING_MODES[modes[0]]


def _max_seq_length(model_dir: Path) -> int | None:
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("max_seq_length")
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    return int(value) if value else None


def pool(hidden: torch.Tensor, starts: list[int], rows: list[int], pooling: str) -> torch.Tensor:
    """[len(rows), hidden] float32: each row's tokens (hidden[starts[r]:starts[r + 1]]) pooled."""
    import torch  # not at the top: PoolingParams reaches processes without torch (a gateway's, via engine.messages)

    if pooling == "cls":
        index = [starts[r] for r in rows]
    elif pooling == "last":
        index = [starts[r + 1] - 1 for r in rows]
    else:
        return torch.stack([hidden[starts[r] : starts[r + 1]].float().mean(0) for r in rows])
    return hidden[torch.tensor(index, device=hidden.device)].float()


def truncate_embedding(row: np.ndarray, dimensions: int | None) -> np.ndarray:
    """A request's embedding: its first `dimensions` values normalised again (all of them: as is)."""
    if dimensions is None or dimensions >= len(row):
        return np.ascontiguousarray(row, dtype=np.float32)
    head = row[:dimensions].astype(np.float32)
    return head / max(float(np.linalg.norm(head)), 1e-12)


def label_probabilities(logits: np.ndarray, multi_label: bool = False) -> np.ndarray:
    """A classifier's probabilities of its labels: softmax over them; the sigmoid of a lone one, or of each one
    when its labels are not exclusive (`multi_label`)."""
    values = logits.astype(np.float64)
    if len(values) == 1 or multi_label:
        return 1.0 / (1.0 + np.exp(-values))
    exp = np.exp(values - values.max())
    return exp / exp.sum()


def relevance_scores(logits: np.ndarray, activation: str) -> list[float]:
    """A cross-encoder's score of each pair from its one logit each (`ClassifierConfig.score_activation`)."""
    values = logits.astype(np.float64)
    return (1.0 / (1.0 + np.exp(-values)) if activation == "sigmoid" else values).tolist()


def cosine_scores(vectors: np.ndarray, pairs: list[tuple[int, int]]) -> list[float]:
    """A bi-encoder's score of each pair of rows of `vectors`: the cosine of their embeddings."""
    unit = vectors.astype(np.float64)
    unit /= np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    return [float(unit[a] @ unit[b]) for a, b in pairs]
