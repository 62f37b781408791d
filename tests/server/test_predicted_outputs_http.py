"""Predicted Outputs over HTTP (`prediction` on /v1/chat/completions, as OpenAI's client sends it): the reply is
the one without a prediction, streamed or not, and `usage.completion_tokens_details` says how much of the
prediction the model took; a prediction of another shape is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from llmserve.model.corpus import ENGLISH_WORDS
from tests.server.conftest import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def body(live_server: LiveServer) -> dict:
    """Greedy whole-word tokens (the random model's byte tokens would not tokenize back from their text)."""
    tokenizer = live_server.engine.tokenizer
    allowed = [ids[0] for word in ENGLISH_WORDS if len(ids := tokenizer.encode(" " + word, add_special_tokens=False)) == 1]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Rewrite the list"}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "allowed_token_ids": allowed}


def test_the_reply_is_unchanged_and_usage_tells_what_was_taken(live_server: LiveServer, body: dict) -> None:
    client = live_server.client()
    extra = {key: body[key] for key in ("ignore_eos", "allowed_token_ids")}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=body["messages"], max_tokens=48, temperature=0,
                                           extra_body=extra)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no prediction counts
    predicted = client.chat.completions.create(
        model=MODEL_NAME, messages=body["messages"], max_tokens=48, temperature=0, extra_body=extra,
        prediction={"type": "content", "content": [{"type": "text", "text": text[:60]}, {"type": "text",
                                                                                            "text": text[60:]}]})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 40 and details.rejected_prediction_tokens == 0
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens == 48
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=body["messages"], max_tokens=48, temperature=0, extra_body=extra, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": "unlike it in every way"})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == 0


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, "prediction.content"),
])
def test_a_prediction_of_another_shape_is_a_400_naming_it(live_server: LiveServer, body: dict, prediction: dict,
                                                          param: str) -> None:
    answer = httpx.post(f"{live_server.base_url}/v1/chat/completions", json={**body, "prediction": prediction},
                        timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"].startswith(param)
