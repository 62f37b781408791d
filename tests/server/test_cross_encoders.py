"""Cross-encoder rerankers and text classifiers (sequence-classification models, random weights in the layouts
of ms-marco-MiniLM and bge-reranker): /v1/score and /v1/rerank give sentence-transformers' CrossEncoder scores
of each pair, /classify gives transformers' label probabilities, and long pairs are cut as the tokenizer cuts
them or refused."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.model_facts import load_model
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.llm import LLM
from llmserve.server.app import ModelSpec, build_app
from tests import hf_reference
from tests.hf_reference import build_cross_encoder
from tests.server.conftest import LiveServer, idle_stats, one_thread_engine_cores, start_server
from tests.server.test_embeddings import minilm_dir  # noqa: F401 - fixture

sentence_transformers = pytest.importorskip("sentence_transformers")

QUERY = "Which animal jumps over the dog?"
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps the KV cache in blocks.",
             "A fox is an animal.", "Throughput and latency of a serving engine."]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)  # 180 tokens, past the 128 the models read
LABELS = ("negative", "neutral", "positive")
KINDS = ("bert", "xlm-roberta")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("cross-encoders")
    built = {kind: build_cross_encoder(kind, root / kind, minilm_dir) for kind in KINDS}
    built["classifier"] = build_cross_encoder("bert", root / "classifier", minilm_dir, labels=LABELS, seed=1)
    return built


@pytest.fixture(scope="module")
def engines(checkpoints: dict[str, Path]) -> Iterator[dict[str, AsyncLLM]]:
    started: dict[str, AsyncLLM] = {}
    try:
        with one_thread_engine_cores():
            for name, path in checkpoints.items():
                started[name] = AsyncLLM.from_config(EngineConfig(model=str(path), dtype="float32"))
        yield started
    finally:
        for engine in started.values():
            engine.close()


@pytest.fixture(scope="module")
def server(checkpoints: dict[str, Path], engines: dict[str, AsyncLLM]) -> Iterator[LiveServer]:
    app = build_app(models=[ModelSpec(name, engine, root=str(checkpoints[name])) for name, engine in engines.items()])
    uvicorn_server, thread, base_url, loop = start_server(app)
    try:
        yield LiveServer(base_url=base_url, engine=engines["bert"], app=app, loop=loop, model="bert")
    finally:
        uvicorn_server.should_exit = True
        thread.join(timeout=30)


def _post(server: LiveServer, path: str, status: int = 200, **body) -> dict:
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def _pair_tokens(model_dir: Path, pairs: list[tuple[str, str]]) -> int:
    tokenizer = sentence_transformers.CrossEncoder(str(model_dir), device="cpu").tokenizer
    return sum(len(tokenizer(a, b)["input_ids"]) for a, b in pairs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cross_encoder_scores_each_pair_as_sentence_transformers(
    server: LiveServer, checkpoints: dict[str, Path], kind: str
) -> None:
    reference = sentence_transformers.CrossEncoder(str(checkpoints[kind]), device="cpu")
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS]).astype(np.float64)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    ranked = _post(server, "/v1/rerank", model=kind, query=QUERY, documents=DOCUMENTS)
    assert [r["index"] for r in ranked["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]], expected[order], atol=1e-5)
    pairs = [(QUERY, d) for d in DOCUMENTS]
    assert ranked["usage"]["prompt_tokens"] == _pair_tokens(checkpoints[kind], pairs)  # each pair read whole
    scored = _post(server, "/v1/score", model=kind, text_1=DOCUMENTS[:2], text_2=[DOCUMENTS[2], QUERY])
    np.testing.assert_allclose([d["score"] for d in scored["data"]],
                               reference.predict([(DOCUMENTS[0], DOCUMENTS[2]), (DOCUMENTS[1], QUERY)]), atol=1e-5)
    # the pair's order matters (BERT's second text is token type 1; RoBERTa's positions differ)
    swapped = _post(server, "/v1/score", model=kind, text_1=DOCUMENTS[2], text_2=DOCUMENTS[0])
    assert swapped["data"][0]["score"] != pytest.approx(scored["data"][0]["score"], abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_pair_is_cut_longest_text_first_or_refused(
    server: LiveServer, checkpoints: dict[str, Path], kind: str
) -> None:
    refused = _post(server, "/v1/rerank", 400, model=kind, query=QUERY, documents=["d", LONG])
    assert refused["error"]["param"] == "documents[1]"
    for keep, documents in ((-1, [LONG, DOCUMENTS[0]]), (40, [LONG, LONG[:150]])):
        reference = sentence_transformers.CrossEncoder(str(checkpoints[kind]), device="cpu",
                                                       max_length=128 if keep == -1 else keep)
        ranked = _post(server, "/v1/rerank", model=kind, query=QUERY, documents=documents, truncate_prompt_tokens=keep)
        scores = {r["index"]: r["relevance_score"] for r in ranked["results"]}
        np.testing.assert_allclose([scores[0], scores[1]], reference.predict([(QUERY, d) for d in documents]),
                                   atol=1e-5)


def test_classify_gives_each_input_its_label_probabilities(server: LiveServer, checkpoints: dict[str, Path]) -> None:
    import transformers

    texts = DOCUMENTS[:3]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["classifier"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoints["classifier"]).eval()
    with torch.no_grad():
        probs = [torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0].double(), -1).numpy()
                 for text in texts]
    answer = _post(server, "/classify", model="classifier", input=texts)
    assert answer["object"] == "list" and answer["id"].startswith("classify-") and answer["model"] == "classifier"
    for i, (item, expected) in enumerate(zip(answer["data"], probs, strict=True)):
        assert item["index"] == i and item["num_classes"] == 3 and item["label"] == LABELS[int(np.argmax(expected))]
        np.testing.assert_allclose(item["probs"], expected, atol=1e-5)
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    by_ids = _post(server, "/classify", model="classifier", input=tokenizer(texts[1])["input_ids"])
    np.testing.assert_allclose(by_ids["data"][0]["probs"], probs[1], atol=1e-5)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"model": "bert", "input": "a fox"}, "model"),  # a cross-encoder does not embed
    ("/v1/score", {"model": "classifier", "text_1": "a", "text_2": "b"}, "model"),  # three labels: no one score
    ("/classify", {"model": "classifier", "input": []}, "input"),
    # [CLS] a [SEP] b [SEP]: 3 special tokens, so a pair needs 5
    ("/v1/rerank", {"model": "bert", "query": "q", "documents": ["d"], "truncate_prompt_tokens": 4},
     "truncate_prompt_tokens"),
    ("/classify", {"model": "classifier", "input": "a", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
])
def test_what_a_classifier_cannot_do_is_a_400(
    server: LiveServer, engines: dict[str, AsyncLLM], path: str, body: dict, param: str
) -> None:
    error = _post(server, path, 400, **body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    for engine in engines.values():  # nothing left running, no block leaked
        assert asyncio.run_coroutine_threadsafe(idle_stats(engine), server.loop).result(60).num_unfinished_requests == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"task": "embed"}, "cannot embed"),
    ({"task": "generate"}, "cannot generate"),
    ({"pooling": "mean"}, "--pooling does not apply"),
])
def test_a_classifier_serves_only_as_one(checkpoints: dict[str, Path], options: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(EngineConfig(model=str(checkpoints["bert"]), **options))


def test_what_a_checkpoint_says_of_its_labels_positions_activation_and_step_budget(
    tmp_path: Path, checkpoints: dict[str, Path], minilm_dir: Path, tiny_llama_dir: Path  # noqa: F811
) -> None:
    facts, _ = load_model(EngineConfig(model=str(checkpoints["xlm-roberta"])))
    assert facts.max_model_len == 128  # 130 positions, the first two before pad id 1's successor
    # an encoder's step budget: many whole inputs a step; a decoder's: prefill chunks; a configured one: as set
    assert facts.max_num_batched_tokens == 8192
    assert load_model(EngineConfig(model=str(tiny_llama_dir)))[0].max_num_batched_tokens == 1024
    assert load_model(EngineConfig(model=str(minilm_dir), max_num_batched_tokens=200))[0].max_num_batched_tokens == 200
    assert facts.classifier is not None and facts.classifier.score_activation == "sigmoid"
    assert load_model(EngineConfig(model=str(checkpoints["classifier"])))[0].classifier.labels == LABELS  # type: ignore[union-attr]
    with pytest.raises(ModelLoadError, match="needs a sequence-classification model"):
        load_model(EngineConfig(model=str(minilm_dir), task="classify"))
    copy = tmp_path / "copy"
    shutil.copytree(checkpoints["bert"], copy)
    config = json.loads((copy / "config.json").read_text())
    for activation, expected in (("torch.nn.modules.linear.Identity", "identity"), ("torch.nn.Tanh", None)):
        config["sentence_transformers"] = {"activation_fn": activation}
        (copy / "config.json").write_text(json.dumps(config))
        if expected is None:
            with pytest.raises(ModelLoadError, match="Tanh"):
                load_model(EngineConfig(model=str(copy)))
        else:
            assert load_model(EngineConfig(model=str(copy)))[0].classifier.score_activation == expected  # type: ignore[union-attr]


def test_an_xlm_roberta_encoder_embeds_as_transformers(tmp_path: Path, minilm_dir: Path) -> None:  # noqa: F811
    """bge-m3's layout (XLMRobertaModel): the first token's state, normalised, with RoBERTa's positions."""
    import transformers

    model_dir = build_cross_encoder("xlm-roberta", tmp_path / "encoder", minilm_dir, labels=None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    texts = [LONG[:300], *DOCUMENTS]
    with torch.no_grad():
        expected = [torch.nn.functional.normalize(model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0],
                                                  dim=0).numpy() for t in texts]
    embedded = [output.outputs.embedding for output in LLM(model=str(model_dir), dtype="float32").embed(texts)]
    np.testing.assert_allclose(embedded, expected, atol=1e-5)


def test_offline_score_and_classify(
    server: LiveServer, checkpoints: dict[str, Path], minilm_dir: Path  # noqa: F811
) -> None:
    """`LLM.score` and `LLM.classify` (vLLM's offline API) give what the server gives."""
    reranker = LLM(model=str(checkpoints["bert"]), dtype="float32")
    expected = sentence_transformers.CrossEncoder(str(checkpoints["bert"]), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS])
    scored = reranker.score(QUERY, DOCUMENTS)
    np.testing.assert_allclose([s.outputs.score for s in scored], expected, atol=1e-5)
    assert scored[0].prompt_token_ids == reranker.get_tokenizer().encode_pair(QUERY, DOCUMENTS[0])[0]
    with pytest.raises(InvalidRequestError, match="does not embed"):
        reranker.embed(QUERY)
    classified = LLM(model=str(checkpoints["classifier"]), dtype="float32").classify(DOCUMENTS[:2])
    served = _post(server, "/classify", model="classifier", input=DOCUMENTS[:2])["data"]
    assert [c.outputs.num_classes for c in classified] == [3, 3]
    np.testing.assert_allclose([c.outputs.probs for c in classified], [d["probs"] for d in served], atol=1e-6)
    embedder = LLM(model=str(minilm_dir), dtype="float32")
    vectors = [o.outputs.data for o in embedder.embed([QUERY, *DOCUMENTS[:2]])]
    cosines = [float(v @ vectors[0] / np.linalg.norm(v) / np.linalg.norm(vectors[0])) for v in vectors[1:]]
    np.testing.assert_allclose([s.outputs.score for s in embedder.score(QUERY, DOCUMENTS[:2])], cosines, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="no labels"):
        embedder.classify(QUERY)



@pytest.mark.parametrize("case", ["qwen3", "llama"])
def test_a_decoder_classifier_scores_and_classifies_as_transformers(
    tmp_path: Path, tiny_llama_dir: Path, case: str
) -> None:
    """Qwen3ForSequenceClassification / LlamaForSequenceClassification (reward models, Qwen3-Reranker's seq-cls
    form): the `score` head on the last token of the text, or of the pair joined as the tokenizer joins it."""
    import transformers

    one_label = hf_reference.build_checkpoint(case, tmp_path / "reranker", tiny_llama_dir, labels=("LABEL_0",))
    tokenizer = transformers.AutoTokenizer.from_pretrained(one_label)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(one_label).eval()

    def logits(model, *texts: str) -> torch.Tensor:
        with torch.no_grad():
            return model(**tokenizer(*texts, return_tensors="pt")).logits[0].double()

    reranker = LLM(model=str(one_label), dtype="float32")
    scored = reranker.score(QUERY, DOCUMENTS)
    expected = [torch.sigmoid(logits(reference, QUERY, d))[0].item() for d in DOCUMENTS]
    np.testing.assert_allclose([s.outputs.score for s in scored], expected, atol=1e-5)
    assert scored[0].prompt_token_ids == tokenizer(QUERY, DOCUMENTS[0])["input_ids"]
    with pytest.raises(InvalidRequestError, match="does not embed"):
        reranker.embed(QUERY)
    with pytest.raises(InvalidRequestError):  # no language-model head
        reranker.generate("Once upon a time")
    three_labels = hf_reference.build_checkpoint(case, tmp_path / "classifier", tiny_llama_dir, labels=LABELS, seed=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(three_labels).eval()
    classified = LLM(model=str(three_labels), dtype="float32").classify(DOCUMENTS[:2])
    np.testing.assert_allclose([c.outputs.probs for c in classified],
                               [torch.softmax(logits(model, d), -1).numpy() for d in DOCUMENTS[:2]], atol=1e-5)


def test_a_causal_lm_scored_by_two_tokens_as_qwen3_reranker(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """vLLM's `hf_overrides` for Qwen3-Reranker: the causal LM served as a classifier whose score is the softmax
    of its "no" and "yes" logits at the pair's last token, P(yes)."""
    import transformers

    model_dir = hf_reference.build_checkpoint("qwen3", tmp_path / "qwen3", tiny_llama_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    no, yes = (tokenizer.convert_ids_to_tokens(i) for i in (7, 11))  # two tokens of the tiny vocabulary
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        last = [reference(**tokenizer(QUERY, d, return_tensors="pt")).logits[0, -1].double() for d in DOCUMENTS]
    expected = [torch.softmax(logits[[7, 11]], -1)[1].item() for logits in last]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes]}
    reranker = LLM(model=str(model_dir), dtype="float32", hf_overrides=overrides)
    np.testing.assert_allclose([s.outputs.score for s in reranker.score(QUERY, DOCUMENTS)], expected, atol=1e-5)
    with pytest.raises(ModelLoadError, match="not tokens of the model's vocabulary"):
        load_model(EngineConfig(model=str(model_dir), hf_overrides={**overrides, "classifier_from_token": ["n0pe", yes]}))


def test_hf_overrides_flag_takes_a_json_object() -> None:
    from llmserve.cli import build_parser
    from llmserve.config import engine_config_kwargs

    parser = build_parser()
    args = parser.parse_args(["serve", "--hf-overrides", '{"architectures": ["Qwen3ForSequenceClassification"]}'])
    assert engine_config_kwargs(args)["hf_overrides"] == {"architectures": ["Qwen3ForSequenceClassification"]}
    assert engine_config_kwargs(parser.parse_args(["serve"]))["hf_overrides"] is None
    for bad in ("not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--hf-overrides", bad])
