"""OpenAI's moderation results (/v1/moderations), from a classifier's label probabilities or from the content
filter's rules, and which of the two answers a request. Torch-free: the server and the gateway share it.

A request names a served sequence-classification model (a moderation classifier), or one of OpenAI's moderation
models, which is the model served (or aliased) under that name when there is one, else the content filter. A
classifier's labels are the categories, less the ones that mean "nothing wrong" (`SAFE_LABELS`); a category is
flagged at a probability of `FLAG_THRESHOLD` or more. The content filter's categories are its rules' (a rule set's
"word" and "regex", and the config's named `categories`), each scored 1 when one of its rules matches the text,
else 0."""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.platform.safety import SafetyFilter

# What OpenAI's client sends when its caller names no model, and its other moderation models' names.
DEFAULT_MODERATION_MODEL = "omni-moderation-latest"
OPENAI_MODERATION_MODELS = frozenset({
    DEFAULT_MODERATION_MODEL, "omni-moderation-2024-09-26", "text-moderation-latest", "text-moderation-stable",
    "text-moderation-007",
})
CONTENT_FILTER_MODEL = "content-filter"  # the name the content filter answers to as a moderation model
FLAG_THRESHOLD = 0.5
# Labels moderation classifiers give text that is fine (compared casefolded): not categories of harm.
SAFE_LABELS = frozenset({
    "ok", "safe", "neutral", "normal", "benign", "clean", "none", "non-toxic", "non_toxic", "nontoxic", "not_toxic",
    "not toxic",
})


def moderation_model(requested: str | None, served_names: Sequence[str], has_filter: bool) -> str | None:
    """The model a moderation request runs on: a served model (or alias) it names, or, for none named, the one
    served as OpenAI's default; the content filter (CONTENT_FILTER_MODEL) for OpenAI's moderation models that
    are not served, or when asked for by name; None when the filter would be, but there is none. A name neither
    served nor OpenAI's is returned as it is (for the caller's 404)."""
    name = requested if requested is not None else DEFAULT_MODERATION_MODEL
    if name in served_names or (name not in OPENAI_MODERATION_MODELS and name != CONTENT_FILTER_MODEL):
        return name
    return CONTENT_FILTER_MODEL if has_filter else None


def classifier_result(labels: Sequence[str], probabilities: Sequence[float]) -> dict:
    """One input's result from a classifier's label probabilities."""
    return _result({label: float(p) for label, p in zip(labels, probabilities, strict=True)
                    if label.casefold() not in SAFE_LABELS})


def filter_result(safety_filter: SafetyFilter, text: str) -> dict:
    """One input's result from the content filter: every category it knows, 1 for those the text hits."""
    matched = safety_filter.matched_categories(text)
    categories = dict.fromkeys([*safety_filter.categories, *matched], 0.0)
    categories.update(dict.fromkeys(matched, 1.0))
    return _result(categories)


def _result(scores: dict[str, float]) -> dict:
    flags = {category: score >= FLAG_THRESHOLD for category, score in scores.items()}
    return {
        "flagged": any(flags.values()),
        "categories": flags,
        "category_scores": scores,
        "category_applied_input_types": {category: ["text"] for category in scores},
    }


def moderation_body(response_id: str, model: str, results: list[dict], usage: dict[str, int]) -> dict:
    """The response body in OpenAI's shape, with the tokens a model read as `usage` (none for the filter)."""
    return {"id": response_id, "model": model, "results": results, "usage": usage}
