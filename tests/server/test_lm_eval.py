"""The issue's proof: lm-evaluation-harness (`local-completions`, which sends echo + logprobs with
max_tokens 1) runs a small loglikelihood task, defined here, against a live server, and each item's
logprob and greedy flag equal what transformers computes on the same weights in float32."""

from __future__ import annotations

import json

import lm_eval
import pytest
import torch

from tests import hf_reference
from tests.server.conftest import MODEL_NAME

TASK = "llmserve_tiny_loglikelihood"
DOCS = [
    {"context": "The cat sat on the", "choices": ["mat", "dog", "moon"], "answer": 0},
    {"context": "One, two, three,", "choices": ["four", "five six seven"], "answer": 0},
    {"context": "Paris is the capital of", "choices": ["France", "the moon", "a"], "answer": 0},
]


def _write_task(directory) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )


@torch.no_grad()
def _reference(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """lm_eval's split (encode the whole, the context's tokens first) scored by transformers."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    positions = range(len(context_ids), len(whole))
    total = sum(float(logprobs[i - 1, whole[i]]) for i in positions)
    greedy = all(int(logprobs[i - 1].argmax()) == whole[i] for i in positions)
    return total, greedy


def test_lm_eval_local_completions_matches_transformers(live_server, tiny_llama_dir, tmp_path, monkeypatch):
    import transformers
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    _write_task(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL_NAME,
            "base_url": f"{live_server.base_url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tiny_llama_dir),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    model = hf_reference.load_model(tiny_llama_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    checked = 0
    for sample in samples:
        doc = sample["doc"]
        assert len(sample["resps"]) == len(doc["choices"])
        for (context, continuation), response in zip(sample["arguments"], sample["resps"], strict=True):
            assert context == doc["context"]
            logprob, greedy = response[0]
            expected_logprob, expected_greedy = _reference(model, tokenizer, context, continuation)
            assert logprob == pytest.approx(expected_logprob, abs=1e-3)
            assert greedy == expected_greedy
            checked += 1
    assert checked == sum(len(doc["choices"]) for doc in DOCS)
    assert live_server.idle_stats().num_used_blocks == 0
