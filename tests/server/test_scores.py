"""POST /v1/score and /v1/rerank (also /rerank and /v2/rerank) on all-MiniLM-L6-v2: each score is the cosine
similarity of sentence-transformers' embeddings of the two texts, documents come back ordered by it, and bad
requests are 400s naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.conftest import LiveServer
from tests.server.test_embeddings import MODEL, minilm_dir, server  # noqa: F401 - fixtures

QUERY = "Which animal jumps over the dog?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps the KV cache in blocks.",
             "A fox is an animal.", "Throughput and latency of a serving engine."]


@pytest.fixture(scope="module")
def encode(minilm_dir: Path):  # noqa: F811
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    return lambda texts: model.encode(texts, convert_to_numpy=True).astype(np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _post(server: LiveServer, path: str, **body) -> dict:  # noqa: F811
    response = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _tokens(server: LiveServer, texts: list[str]) -> int:  # noqa: F811
    embedded = _post(server, "/v1/embeddings", input=texts)
    return embedded["usage"]["prompt_tokens"]


def test_a_score_is_the_cosine_of_the_two_embeddings(server: LiveServer, encode) -> None:  # noqa: F811
    one_to_many = _post(server, "/v1/score", text_1=QUERY, text_2=DOCUMENTS)
    vectors = encode([QUERY, *DOCUMENTS])
    expected = [_cosine(vectors[0], v) for v in vectors[1:]]
    assert [d["index"] for d in one_to_many["data"]] == list(range(len(DOCUMENTS)))
    assert {d["object"] for d in one_to_many["data"]} == {"score"} and one_to_many["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], expected, atol=1e-5)
    assert one_to_many["model"] == MODEL and one_to_many["id"].startswith("score-")
    assert one_to_many["usage"]["prompt_tokens"] == _tokens(server, [QUERY, *DOCUMENTS])
    pairwise = _post(server, "/score", text_1=DOCUMENTS[:2], text_2=[DOCUMENTS[2], DOCUMENTS[2]])
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [_cosine(vectors[1], vectors[3]), _cosine(vectors[2], vectors[3])], atol=1e-5)
    # a text asked for twice is embedded (and metered) once
    assert pairwise["usage"]["prompt_tokens"] == _tokens(server, DOCUMENTS[:3])
    same = _post(server, "/v1/score", text_1="a fox", text_2="a fox")
    assert same["data"][0]["score"] == pytest.approx(1.0, abs=1e-6)
    assert server.idle_stats().num_unfinished_requests == 0


def test_rerank_orders_the_documents_by_relevance(server: LiveServer, encode) -> None:  # noqa: F811
    vectors = encode([QUERY, *DOCUMENTS])
    scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]  # strings or Cohere's objects
    ranked = _post(server, "/v1/rerank", query=QUERY, documents=documents)
    assert [r["index"] for r in ranked["results"]] == order and ranked["id"].startswith("rerank-")
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], [scores[i] for i in order],
                               atol=1e-5)
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in order]
    assert ranked["usage"]["total_tokens"] == _tokens(server, [QUERY, *DOCUMENTS])
    for path in ("/rerank", "/v2/rerank"):
        top = _post(server, path, query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=False)
        assert [r["index"] for r in top["results"]] == order[:2] and all("document" not in r for r in top["results"])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["c", 3]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["c", "word " * 300]}, "text_2[1]"),  # past what the model embeds
    ("/v1/rerank", {"query": "q", "documents": ["d", "e", "word " * 300]}, "documents[2]"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "rank_fields": ["title"]}, "rank_fields"),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "d"}]}, "documents[0]"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "truncate_prompt_tokens": 2000}, "truncate_prompt_tokens"),
])
def test_bad_requests_are_400s_naming_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:  # noqa: F811
    response = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"].startswith(param), error


def test_a_model_that_does_not_embed_cannot_score(live_server: LiveServer) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/rerank",
                          json={"model": live_server.model, "query": "q", "documents": ["d"]}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_a_model_without_labels_cannot_classify(server: LiveServer) -> None:  # noqa: F811
    response = httpx.post(f"{server.base_url}/classify", json={"model": MODEL, "input": "a fox"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
