"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client and httpx.

Covers: chat and completions, streamed and not (the joined stream equals the non-streamed text for
greedy and seeded requests, usage equals the token counts), n=2, stop, logprobs in both shapes,
include_usage, echo, the raw SSE format, every bad input by status / error type / param, admission
control, metrics, 200 concurrent streams, clients that disconnect (streaming or not) and streams that
keep flowing while a long prompt is prefilled. Nothing sleeps: the engine client reports idleness.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.app import build_app
from llmserve.server.streaming import PROGRESS_HEADER
from tests import faulty_model
from tests.server.conftest import MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MODEL_NAME, LiveServer, idle_stats

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a story about a fox and a crow."},
]
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "def fibonacci(n):",
    "Un café au lait, s'il vous plaît. 日本語",
]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(live_server: LiveServer) -> LiveServer:
    return live_server


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def http(server: LiveServer):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def _count_tokens(http: httpx.Client, **body) -> int:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["count"] == len(data["tokens"])
    return data["count"]


def _assert_idle_and_empty(server: LiveServer) -> None:
    stats = server.idle_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_unfinished_requests == 0
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks


def _join_chat_stream(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "one finish_reason per choice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


# ---- models, health, tokenizer --------------------------------------------------------------------


def test_models_health_version_metrics(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    metrics = http.get("/metrics")
    assert metrics.status_code == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{model_name="{MODEL_NAME}"}}' in metrics.text


def test_tokenize_and_detokenize_round_trip(server, http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    assert tokens["tokens"] == server.engine.tokenizer.encode("Hello world")
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == server.engine.tokenizer.decode(tokens["tokens"])
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == server.engine.tokenizer.apply_chat_template(MESSAGES, tokenize=True)


def test_a_non_streamed_reply_with_usage_progress_events_then_the_response(http):
    messages = [{"role": "user", "content": "A reply counted as it goes"}]  # (MESSAGES stay out of the cache)
    body = {"messages": messages, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()
    with http.stream("POST", "/v1/chat/completions", json=body, headers={PROGRESS_HEADER: "1"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    *progress, whole = data
    counts = [event["usage"]["completion_tokens"] for event in progress]
    assert counts and counts[0] >= 16 and counts[-1] < 40  # every 16 tokens or more, before the end
    assert all(later - earlier >= 16 for earlier, later in zip(counts, counts[1:], strict=False))
    assert all(set(event) == {"usage"} for event in progress)
    assert whole["choices"] == plain["choices"]
    counted = ("prompt_tokens", "completion_tokens")  # (the second one's prompt hit the prefix cache)
    assert [whole["usage"][name] for name in counted] == [plain["usage"][name] for name in counted]


def test_tokenize_counts_several_prompts_at_once_and_a_chats_tools(server, http):
    texts = ["Hello world", "", "Good morning"]
    batch = http.post("/tokenize", json={"prompt": texts}).json()
    expected = [server.engine.tokenizer.encode(text) for text in texts]
    assert batch == {"count": sum(map(len, expected)), "max_model_len": MAX_MODEL_LEN, "tokens": expected,
                     "counts": [len(ids) for ids in expected]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": tools}).json()
    assert with_tools["tokens"] == server.engine.tokenizer.apply_chat_template(MESSAGES, tokenize=True, tools=tools)
    assert with_tools["count"] > http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]


def test_tokenize_bounds_the_number_of_prompts_not_a_prompts_length(http):
    long_prompt = "word " * 3000  # longer, in characters, than the bound on the number of prompts
    assert http.post("/tokenize", json={"prompt": long_prompt}).status_code == 200
    too_many = http.post("/tokenize", json={"prompt": ["hi"] * 2049})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"


# ---- chat completions -----------------------------------------------------------------------------


def test_chat_greedy_stream_equals_non_stream_and_usage_is_exact(server, client, http):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0, extra_body=NO_EOS)
    full = client.chat.completions.create(**kwargs, logprobs=True)
    assert full.object == "chat.completion" and full.model == MODEL_NAME and full.id.startswith("chatcmpl-")
    [choice] = full.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_tokens = _count_tokens(http, messages=MESSAGES)
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 24 == len(choice.logprobs.content)
    assert full.usage.total_tokens == prompt_tokens + 24
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons, usage = _join_chat_stream(chunks)
    assert texts == {0: choice.message.content} and reasons == {0: "length"}
    expected = full.usage.model_dump()
    # The same prompt again: its full KV blocks come from the prefix cache (the last token is recomputed).
    expected["prompt_tokens_details"]["cached_tokens"] = (prompt_tokens - 1) // 16 * 16
    assert usage.model_dump() == expected
    assert chunks[-1].usage is not None  # the usage chunk comes last, before [DONE]


def test_chat_seeded_sampling_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    full = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == again.choices[0].message.content
    texts, _, _ = _join_chat_stream(client.chat.completions.create(**kwargs, stream=True))
    assert texts[0] == full.choices[0].message.content
    other = client.chat.completions.create(**{**kwargs, "seed": 4321})
    assert other.choices[0].message.content != full.choices[0].message.content


def test_chat_n2_choices_each_with_its_index(client):
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7, n=2, extra_body=NO_EOS
    )
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content != full.choices[1].message.content
    assert full.usage.completion_tokens == 24
    texts, reasons, usage = _join_chat_stream(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {c.index: c.message.content for c in full.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 24


def test_chat_stop_string_cuts_the_text(client):
    base = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=0, extra_body=NO_EOS)
    text = client.chat.completions.create(**base).choices[0].message.content
    stop = text[8:11]
    assert stop.strip() and len(text) > 12
    cut = text[: text.find(stop)]
    full = client.chat.completions.create(**base, stop=[stop, "\x00never"])
    assert full.choices[0].message.content == cut and full.choices[0].finish_reason == "stop"
    texts, reasons, _ = _join_chat_stream(client.chat.completions.create(**base, stop=stop, stream=True))
    assert texts == {0: cut} and reasons == {0: "stop"}


def test_chat_logprobs_shape_streamed_and_not(client):
    kwargs = dict(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    full = client.chat.completions.create(**kwargs, extra_body=NO_EOS)
    content = full.choices[0].logprobs.content
    assert len(content) == 8 == full.usage.completion_tokens
    assert bytes(b for entry in content for b in entry.bytes).decode(errors="replace") == full.choices[0].message.content
    for entry in content:
        # a whole token's bytes are its text's; a piece of a character's, its own (the text shows U+FFFD)
        assert entry.logprob <= 0 and (entry.bytes == list(entry.token.encode()) or entry.token == "\ufffd")
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True, extra_body=NO_EOS):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    # The streamed request reuses the first one's cached KV, computed by another kernel path: the
    # same tokens, logprobs equal to float32 rounding.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_chat_content_parts_developer_role_and_echo(client, http):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me a story "}, {"type": "text", "text": "now."}],
        }
    ]
    as_parts = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=6, temperature=0)
    joined = [{"role": "user", "content": "Tell me a story now."}]
    as_string = client.chat.completions.create(model=MODEL_NAME, messages=joined, max_tokens=6, temperature=0)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=developer, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL_NAME, messages=system, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == _count_tokens(http, messages=system)
    # echo (vLLM): a final assistant message is continued, and its content comes back first
    prefix = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    extra = {"echo": True, "add_generation_prompt": False, **NO_EOS}
    echoed = client.chat.completions.create(
        model=MODEL_NAME, messages=prefix, max_tokens=5, temperature=0, extra_body=extra
    )
    assert echoed.choices[0].message.content.startswith("Once upon")
    texts, _, _ = _join_chat_stream(
        client.chat.completions.create(
            model=MODEL_NAME, messages=prefix, max_tokens=5, temperature=0, extra_body=extra, stream=True
        )
    )
    assert texts[0] == echoed.choices[0].message.content


def test_chat_vllm_sampling_extras_are_accepted(client):
    extra = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 4,
        "stop_token_ids": [3],
        "skip_special_tokens": True,
        "priority": 0,
    }
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=6,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="someone",
        extra_body=extra,
    )
    assert out.usage.completion_tokens >= 4 and out.choices[0].finish_reason in ("stop", "length")


def test_continue_final_message_goes_on_with_the_assistants_text(server, client, http):
    begun = [*MESSAGES, {"role": "assistant", "content": "Once upon a time, a fox"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    prompt = server.engine.tokenizer.apply_chat_template(begun, add_generation_prompt=False,
                                                         continue_final_message=True, tokenize=True)
    assert http.post("/tokenize", json={"messages": begun, **extra}).json()["tokens"] == prompt
    assert http.post("/tokenize", json={"messages": begun, "continue_final_message": True}).status_code == 400
    out = client.chat.completions.create(model=MODEL_NAME, messages=begun, max_tokens=5, temperature=0,
                                         extra_body={**extra, **NO_EOS})
    assert out.usage.prompt_tokens == len(prompt)
    same = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].message.content == same.choices[0].text  # the continuation alone, as vLLM's


def test_logit_bias_reaches_the_sampler_in_chat_and_completions(server, client):
    tokenizer = server.engine.tokenizer
    token = tokenizer.encode(" fox", add_special_tokens=False)[0]
    forced = tokenizer.decode([token] * 4)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100}, extra_body=NO_EOS)
    assert out.choices[0].text == forced
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0.7, seed=1,
                                          logit_bias={str(token): 100}, extra_body=NO_EOS)
    assert chat.choices[0].message.content == forced


def test_allowed_token_ids_and_bad_words_reach_the_sampler_in_chat_and_completions(server, client):
    tokenizer = server.engine.tokenizer
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     extra_body=NO_EOS)
    ids = tokenizer.encode(base.choices[0].text, add_special_tokens=False)
    allowed = sorted(set(ids[2:6]))
    narrowed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                         extra_body={**NO_EOS, "allowed_token_ids": allowed})
    lifted = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       logit_bias={str(t): 100 for t in allowed}, extra_body=NO_EOS)
    assert narrowed.choices[0].text == lifted.choices[0].text != base.choices[0].text
    words = {w: tokenizer.encode(f" {w}", add_special_tokens=False) for w in ("the", "and", "of", "to")}
    assert all(len(ids) == 1 for ids in words.values())

    def chat(bad_words: list[str]) -> list[str]:
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1,
            extra_body={**NO_EOS, "bad_words": bad_words, "allowed_token_ids": [ids[0] for ids in words.values()]},
        )
        return out.choices[0].message.content.split()

    free = chat([])
    assert set(free) <= set(words) and len(free) == 8
    banned = max(words, key=free.count)
    assert free.count(banned) >= 2
    constrained = chat([banned])
    assert set(constrained) <= set(words) - {banned} and len(constrained) == 8


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(server, client):
    tokenizer = server.engine.tokenizer
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, extra_body=NO_EOS)
    plain = client.completions.create(**kwargs).choices[0]
    by_id = client.completions.create(**{**kwargs, "extra_body": {**NO_EOS, "return_tokens_as_token_ids": True}})
    by_id = by_id.choices[0]
    ids = [int(token.removeprefix("token_id:")) for token in by_id.logprobs.tokens]
    assert by_id.text == plain.text == tokenizer.decode(ids)
    assert [tokenizer.decode([i]) for i in ids] == plain.logprobs.tokens
    # (the logprobs themselves may differ in the last bits: the second run reads the prompt's KV from the cache)
    assert all(key.startswith("token_id:") for top in by_id.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={**NO_EOS, "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    ids = [int(entry.token.removeprefix("token_id:")) for entry in content]
    assert tokenizer.decode(ids) == chat.choices[0].message.content
    # each entry's bytes are its token's own, so they join into the text (as OpenAI's do)
    assert bytes(b for entry in content for b in entry.bytes).decode(errors="replace") == chat.choices[0].message.content
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


def _token_id_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_gives_the_prompts_and_each_choices_token_ids(server, http):
    tokenizer = server.engine.tokenizer
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 7, "temperature": 0, "return_token_ids": True,
            **NO_EOS}
    whole = http.post(COMPLETIONS, json=body).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPTS[1])
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 7
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = _token_id_chunks(http, COMPLETIONS, body)
    streamed = [c for chunk in chunks for c in chunk["choices"]]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == choice["token_ids"]

    chat_body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                 "return_token_ids": True, **NO_EOS}
    chat = http.post(CHAT, json=chat_body).json()
    prompt = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()["tokens"]
    assert chat["prompt_token_ids"] == prompt and len(chat["choices"][0]["token_ids"]) == 6
    assert tokenizer.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    chunks = _token_id_chunks(http, CHAT, chat_body)
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    # the role chunk has none
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])] == chat["choices"][0][
        "token_ids"]
    # Not asked for, the responses keep OpenAI's shape.
    plain = http.post(CHAT, json={**chat_body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert all("token_ids" not in c["choices"][0] for c in _token_id_chunks(http, COMPLETIONS, {**body, "return_token_ids": False}) if c["choices"])


# ---- completions ----------------------------------------------------------------------------------


def test_completions_prompt_forms_and_choice_numbering(server, client, http):
    tokenizer = server.engine.tokenizer
    single = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=7, temperature=0, extra_body=NO_EOS
    )
    assert single.object == "text_completion" and single.choices[0].finish_reason == "length"
    assert single.usage.prompt_tokens == _count_tokens(http, prompt=PROMPTS[0])
    assert single.usage.completion_tokens == 7

    ids = tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=7, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.choices[0].text == single.choices[0].text

    batch = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:3], max_tokens=5, temperature=1.0, seed=11, n=2, extra_body=NO_EOS
    )
    assert [c.index for c in batch.choices] == list(range(6))
    assert batch.usage.prompt_tokens == sum(_count_tokens(http, prompt=p) for p in PROMPTS[:3])
    assert batch.usage.completion_tokens == 30
    token_lists = [tokenizer.encode(p) for p in PROMPTS[:3]]
    same = client.completions.create(
        model=MODEL_NAME, prompt=token_lists, max_tokens=5, temperature=1.0, seed=11, n=2, extra_body=NO_EOS
    )
    assert [c.text for c in same.choices] == [c.text for c in batch.choices]


def test_completions_stream_equals_non_stream_with_prompt_list(client):
    kwargs = dict(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=9, temperature=1.0, seed=5, n=2, extra_body=NO_EOS
    )
    full = client.completions.create(**kwargs)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {i: "length" for i in range(8)}
    # The second run of the same prompts may reuse their KV from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens_details.cached_tokens
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )


def test_completions_echo_and_legacy_logprobs(client):
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text

    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(logprob)
        assert token in top


def test_completions_stop_and_seeded_stream(client):
    base = dict(
        model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=25, temperature=0.8, seed=99, extra_body=NO_EOS
    )
    text = client.completions.create(**base).choices[0].text
    stop = text[5:8]
    assert stop
    cut = client.completions.create(**base, stop=stop)
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**base, stop=stop, stream=True) if c.choices
    )
    assert streamed == cut.choices[0].text


# ---- raw wire format ------------------------------------------------------------------------------


def test_sse_wire_format(http):
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    text = raw.decode("utf-8")  # strict: every piece is whole UTF-8
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == f"id: {len(events) - 2}\ndata: [DONE]"
    payloads = []
    for number, event in enumerate(events[:-2]):
        id_line, data_line = event.split("\n")  # each event is numbered, for resuming (server/streams.py)
        assert id_line == f"id: {number}" and data_line.startswith("data: ")
        payloads.append(json.loads(data_line[len("data: ") :]))
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    first, *middle, finish, usage = payloads
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["choices"][0]["delta"].get("content") for p in middle), "no empty content deltas"
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        payloads = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    *chunks, last = payloads
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 10  # the role chunk, then each token's
    assert len({chunk["usage"]["prompt_tokens"] for chunk in payloads}) == 1
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks)
    assert last["choices"] == [] and last["usage"] == chunks[-1]["usage"]


# ---- bad input ------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_IDS = [100] * 600


def _chat(**fields):
    return {"model": MODEL_NAME, "messages": MESSAGES, **fields}


def _completion(**fields):
    return {"model": MODEL_NAME, "prompt": "Hello", **fields}


BAD_REQUESTS = [
    # (path, json body, status, type, param, code)
    (CHAT, {"model": MODEL_NAME}, 400, "invalid_request_error", "messages", "missing_required_parameter"),
    (CHAT, _chat(messages=[]), 400, "invalid_request_error", "messages", "invalid_value"),
    (
        CHAT,
        _chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "invalid_request_error",
        "messages[0].role",
        "invalid_value",
    ),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "invalid_request_error",
        "messages[0].content",
        "invalid_value",
    ),
    (CHAT, _chat(temperature="hot"), 400, "invalid_request_error", "temperature", "invalid_value"),
    (CHAT, _chat(temperature=-1), 400, "invalid_request_error", "temperature", None),
    (CHAT, _chat(top_p=0), 400, "invalid_request_error", "top_p", None),
    (CHAT, _chat(n=0), 400, "invalid_request_error", "n", "invalid_value"),
    (CHAT, _chat(max_tokens=0), 400, "invalid_request_error", "max_tokens", "invalid_value"),
    (CHAT, _chat(stop=5), 400, "invalid_request_error", "stop", "invalid_value"),
    (
        CHAT,
        _chat(top_logprobs=50, logprobs=True),
        400,
        "invalid_request_error",
        "top_logprobs",
        "invalid_value",
    ),
    (CHAT, _chat(top_logprobs=2), 400, "invalid_request_error", "top_logprobs", "unsupported_parameter"),
    (CHAT, _chat(model="gpt-4o"), 404, "invalid_request_error", "model", "model_not_found"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": "hi " * 600}]),
        400,
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    ),
    (
        CHAT,
        _chat(max_tokens=MAX_MODEL_LEN),
        400,
        "invalid_request_error",
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        CHAT,
        _chat(max_completion_tokens=MAX_MODEL_LEN),
        400,
        "invalid_request_error",
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        CHAT,
        _chat(functions=[{"name": "f"}]),
        400,
        "invalid_request_error",
        "functions",
        "unsupported_parameter",
    ),
    (CHAT, _chat(tool_choice="required"), 400, "invalid_request_error", "tool_choice", None),
    (
        CHAT,
        _chat(response_format={"type": "json_schema"}),
        400,
        "invalid_request_error",
        "response_format",
        "invalid_value",
    ),
    (CHAT, _chat(logit_bias={"fox": 10}), 400, "invalid_request_error", "logit_bias", None),
    # integers past 64 bits could not reach the engine (its messages are MessagePack): 400s, never 500s
    (CHAT, _chat(seed=2**64), 400, "invalid_request_error", "seed", "invalid_value"),
    (COMPLETIONS, _completion(seed=-(2**63) - 1), 400, "invalid_request_error", "seed", "invalid_value"),
    (COMPLETIONS, _completion(top_k=2**70), 400, "invalid_request_error", "top_k", "invalid_value"),
    (CHAT, _chat(priority=2**70), 400, "invalid_request_error", "priority", "invalid_value"),
    (COMPLETIONS, _completion(truncate_prompt_tokens=2**70), 400, "invalid_request_error", "truncate_prompt_tokens",
     "invalid_value"),
    (CHAT, _chat(continue_final_message=True), 400, "invalid_request_error", "continue_final_message",
     "unsupported_parameter"),
    (CHAT, _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                 continue_final_message=True, add_generation_prompt=False), 400, "invalid_request_error", "messages",
     None),
    (CHAT, _chat(logit_bias={"5": 101}), 400, "invalid_request_error", "logit_bias", None),
    (CHAT, _chat(logit_bias={str(t): 1 for t in range(301)}), 400, "invalid_request_error", "logit_bias",
     "invalid_value"),
    (COMPLETIONS, _completion(stop_token_ids=[5] * 65), 400, "invalid_request_error", "stop_token_ids",
     "invalid_value"),
    (CHAT, _chat(logit_bias={"5": "high"}), 400, "invalid_request_error", "logit_bias.5", "invalid_value"),
    (COMPLETIONS, _completion(logit_bias={"-1": 10}), 400, "invalid_request_error", "logit_bias", None),
    (COMPLETIONS, _completion(logit_bias={"1000000": 10}), 400, "invalid_request_error", "logit_bias", None),
    (CHAT, _chat(safety_identifier="u" * 129), 400, "invalid_request_error", "safety_identifier", "invalid_value"),
    (CHAT, _chat(prompt_cache_retention="1h"), 400, "invalid_request_error", "prompt_cache_retention",
     "invalid_value"),
    (COMPLETIONS, _completion(prompt_cache_options={"ttl": "12h"}), 400, "invalid_request_error",
     "prompt_cache_options.ttl", "invalid_value"),
    (CHAT, _chat(moderation={"model": "omni-moderation-latest"}), 400, "invalid_request_error", "moderation",
     "unsupported_parameter"),
    (COMPLETIONS, _completion(allowed_token_ids=[]), 400, "invalid_request_error", "allowed_token_ids",
     "invalid_value"),
    (CHAT, _chat(allowed_token_ids=[1, 2**70]), 400, "invalid_request_error", "allowed_token_ids", None),
    (CHAT, _chat(allowed_token_ids=[-3]), 400, "invalid_request_error", "allowed_token_ids", None),
    (CHAT, _chat(bad_words=["fox"] * 129), 400, "invalid_request_error", "bad_words", "invalid_value"),
    (COMPLETIONS, _completion(bad_words=["fox " * 200]), 400, "invalid_request_error", "bad_words", None),
    (COMPLETIONS, _completion(bad_words=["\ud800"]), 400, "invalid_request_error", "bad_words", "invalid_value"),
    (
        CHAT,
        _chat(stream_options={"include_usage": True}),
        400,
        "invalid_request_error",
        "stream_options",
        "unsupported_parameter",
    ),
    (CHAT, _chat(min_tokens=10, max_tokens=5), 400, "invalid_request_error", "min_tokens", None),
    (CHAT, _chat(temperature=float("nan")), 400, "invalid_request_error", "temperature", "invalid_value"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": "\ud800"}]),
        400,
        "invalid_request_error",
        "messages[0].content",
        "invalid_value",
    ),
    (CHAT, _chat(messages=[{"role": "user"}]), 400, "invalid_request_error", "messages[0].content", None),
    (
        CHAT,
        _chat(max_tokens=MAX_MODEL_LEN, stream=True),
        400,
        "invalid_request_error",
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        COMPLETIONS,
        {"model": MODEL_NAME},
        400,
        "invalid_request_error",
        "prompt",
        "missing_required_parameter",
    ),
    (COMPLETIONS, _completion(prompt=[]), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, _completion(prompt=[1, "a"]), 400, "invalid_request_error", "prompt", "invalid_value"),
    (COMPLETIONS, _completion(prompt=""), 400, "invalid_request_error", "prompt", None),
    (COMPLETIONS, _completion(prompt=[99999]), 400, "invalid_request_error", "prompt", None),
    (
        COMPLETIONS,
        _completion(prompt=LONG_IDS),
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    ),
    (
        COMPLETIONS,
        _completion(prompt=["ok", "hi " * 600]),
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    ),
    (
        COMPLETIONS,
        _completion(max_tokens=MAX_MODEL_LEN),
        400,
        "invalid_request_error",
        "max_tokens",
        "context_length_exceeded",
    ),
    (COMPLETIONS, _completion(suffix="!"), 400, "invalid_request_error", "suffix", "unsupported_parameter"),
    (COMPLETIONS, _completion(best_of=3), 400, "invalid_request_error", "best_of", "unsupported_parameter"),
    (COMPLETIONS, _completion(logprobs=21), 400, "invalid_request_error", "logprobs", "invalid_value"),
    (
        CHAT,
        _chat(prompt_logprobs=1, stream=True),  # streamed only on /v1/completions
        400,
        "invalid_request_error",
        "prompt_logprobs",
        "unsupported_parameter",
    ),
    (COMPLETIONS, _completion(model="nope"), 404, "invalid_request_error", "model", "model_not_found"),
    (
        COMPLETIONS,
        _completion(prompt=["fine", [1, 2], "x"]),
        400,
        "invalid_request_error",
        "prompt",
        "invalid_value",
    ),
    (COMPLETIONS, _completion(prompt=[[5, 6], []]), 400, "invalid_request_error", "prompt", None),
    (
        COMPLETIONS,
        _completion(prompt=LONG_IDS, stream=True),
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    ),
    ("/detokenize", {"tokens": [10**6]}, 400, "invalid_request_error", "tokens", None),
    ("/tokenize", {}, 400, "invalid_request_error", "prompt", None),
]


@pytest.mark.parametrize(("path", "body", "status", "type_", "param", "code"), BAD_REQUESTS)
def test_bad_input_is_an_openai_error_naming_the_param(http, path, body, status, type_, param, code):
    # json.dumps writes NaN (as some clients do), which httpx's own encoder refuses
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == (type_, param, code)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/tokenize"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_bodies_are_400(http, path, raw):
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None


def test_openais_newer_fields_that_change_no_output_are_taken(client, http):
    cache = {"prompt_cache_key": "tenant-1", "prompt_cache_retention": "24h", "safety_identifier": "h4sh",
             "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
    marked = [{**MESSAGES[0], "content": [{"type": "text", "text": MESSAGES[0]["content"],
                                           "prompt_cache_breakpoint": {"mode": "explicit"}}]}, MESSAGES[1]]
    same = client.chat.completions.create(model=MODEL_NAME, messages=marked, max_tokens=6, temperature=0,
                                          **cache)
    assert same.choices[0].message.content == plain.choices[0].message.content
    completion = http.post(COMPLETIONS, json=_completion(max_tokens=2, **cache))
    assert completion.status_code == 200, completion.text


def test_include_obfuscation_pads_every_chunk_to_a_block_and_changes_no_text(client, http):
    def stream(**options) -> list[str]:
        body = _chat(max_tokens=12, temperature=0, stream=True, stream_options=options, **NO_EOS)
        with http.stream("POST", CHAT, json=body) as response:
            return [line + "\n\n" for line in response.iter_lines() if line.startswith("data: {")]

    plain, padded = stream(), stream(include_obfuscation=True, include_usage=True)
    chunks = [json.loads(event[6:]) for event in padded]
    assert all(len(event.encode()) % 64 == 0 and chunk["obfuscation"] for event, chunk in zip(padded[:-1], chunks[:-1], strict=True))
    assert "obfuscation" not in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] == 12  # the usage chunk
    assert all("obfuscation" not in json.loads(event[6:]) for event in plain)

    def text(events: list[dict]) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])

    assert text(chunks) == text([json.loads(event[6:]) for event in plain]) != ""
    # the openai client takes the padded chunks as it takes OpenAI's
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_obfuscation": True},
                                              extra_body=NO_EOS)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text(chunks)


def test_unknown_fields_are_400s_and_errors_never_break_the_server(server, client, http):
    unknown = http.post(CHAT, json=_chat(max_tokens=3, frobnicate=True))
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate"
    ok = http.post(CHAT, json=_chat(max_tokens=3, metadata={"a": "b"}, store=False))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3
    for path, body, status, *_ in BAD_REQUESTS[:10]:
        assert (
            http.post(
                path, content=json.dumps(body), headers={"content-type": "application/json"}
            ).status_code
            == status
        )
    # the openai client sees the same errors as typed exceptions
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", suffix="y")
    assert info.value.body["param"] == "suffix"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert http.get("/health").status_code == 200
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
    _assert_idle_and_empty(server)


def test_an_unexpected_failure_is_a_500_in_openai_shape_and_serving_goes_on(server, http, monkeypatch):
    def broken(token_id: int) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.app.state.llmserve.default.token_texts, "text", broken)
    response = http.post(CHAT, json=_chat(max_tokens=2, logprobs=True))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    monkeypatch.undo()
    assert http.post(CHAT, json=_chat(max_tokens=2, logprobs=True)).status_code == 200  # same connection
    _assert_idle_and_empty(server)


def test_a_failing_engine_step_fails_requests_and_health_until_a_new_core_serves(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("LLMSERVE_PLUGINS", "tests.faulty_model")
    engine = AsyncLLM.from_config(
        EngineConfig(
            model=str(faulty_model.faulty_copy(tiny_llama_dir, tmp_path / "faulty")), dtype="float32",
            num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
        )
    )
    app = build_app(engine, MODEL_NAME)
    poison = {"model": MODEL_NAME, "prompt": [5, faulty_model.FAULT_TOKEN], "max_tokens": 5}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            streamed = await http.post(COMPLETIONS, json={**poison, "stream": True})
            assert streamed.status_code == 200
            events = [e.split("\n")[-1] for e in streamed.text.split("\n\n") if e]  # without the id lines
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: ") :])["error"]
            assert error["code"] == "engine_dead" and "injected fault" in error["message"]
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            refused = await http.post(CHAT, json=_chat(max_tokens=5))
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
            assert int(refused.headers["retry-after"]) >= 1
            while (await http.get("/health")).status_code == 503:  # as a load balancer would poll it
                await asyncio.sleep(0.05)
            served = await http.post(CHAT, json=_chat(max_tokens=5))
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 5
            metrics = (await http.get("/metrics")).text
            assert f'llmserve:engine_core_restarts_total{{model_name="{MODEL_NAME}"}} 1.0' in metrics

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=120))
    finally:
        engine.close()


def test_admission_control_is_a_503_with_retry_after(server, http):
    state = server.app.state.llmserve.default
    state.max_waiting_requests = 0
    try:
        for path, body in (
            (CHAT, _chat(max_tokens=2)),
            (COMPLETIONS, _completion(max_tokens=2, stream=True)),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 503
            assert int(response.headers["retry-after"]) >= 1
            error = response.json()["error"]
            assert error["type"] == "service_unavailable_error" and error["code"] == "overloaded"
        assert http.get("/health").status_code == 200  # only generation is refused
    finally:
        state.max_waiting_requests = 1024
    assert http.post(CHAT, json=_chat(max_tokens=2)).status_code == 200


# ---- concurrency, disconnects, long prefills ------------------------------------------------------


async def _stream_chat(http: httpx.AsyncClient, body: dict) -> tuple[str, str | None, dict | None]:
    """Run one streaming chat request; return the joined text, finish_reason and usage."""
    text, reason, usage = "", None, None
    async with http.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason, usage


def test_200_concurrent_streams_complete_and_free_the_pool(server, client):
    bodies = [
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for p in PROMPTS
    ]
    expected = [
        client.chat.completions.create(
            model=MODEL_NAME, messages=b["messages"], max_tokens=12, temperature=0, extra_body=NO_EOS
        )
        .choices[0]
        .message.content
        for b in bodies
    ]

    async def main():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_stream_chat(http, bodies[i % 4]) for i in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200
    for i, (text, reason, usage) in enumerate(results):
        assert reason == "length" and usage["completion_tokens"] == 12
        assert text == expected[i % 4]
    _assert_idle_and_empty(server)


def test_clients_that_disconnect_free_everything(server):
    engine = server.engine
    aborted_before = engine.num_aborted
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def read_then_hang_up(http: httpx.AsyncClient) -> int:
        chunks = 0
        async with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as http:
            counts = await asyncio.gather(*(read_then_hang_up(http) for _ in range(50)))
            assert counts == [3] * 50
            await server.ask_async(AsyncLLM.wait_idle)  # the hung-up streams are gone: "running" below is these four
            # non-streaming: the client gives up once its request is running
            pending = [asyncio.ensure_future(http.post(CHAT, json=body)) for _ in range(4)]
            while (await server.ask_async(AsyncLLM.stats)).num_running < 4:
                pass  # each answer comes from the engine core, between its steps
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return await server.ask_async(idle_stats)

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0
    assert engine.num_aborted - aborted_before == 54, "every hung-up request was aborted, none ran to its end"


def test_streams_keep_flowing_while_a_long_prompt_is_prefilled(server, client, http):
    tokenizer = server.engine.tokenizer
    full_chunk = list(range(100, 100 + MAX_NUM_BATCHED_TOKENS))  # a prompt that fills one step's budget
    long_prompt = [100 + (i * 7) % 800 for i in range(MAX_MODEL_LEN - 8)]  # ~8 chunks of prefill
    assert len(tokenizer.decode(long_prompt)) > 0

    def one_full_step() -> float:
        start = time.perf_counter()
        client.completions.create(model=MODEL_NAME, prompt=full_chunk, max_tokens=1)
        return time.perf_counter() - start

    step_time = statistics.median(one_full_step() for _ in range(5))

    async def main():
        arrivals: list[list[float]] = [[] for _ in range(8)]
        started = [asyncio.Event() for _ in range(8)]
        body = {
            "model": MODEL_NAME,
            "prompt": PROMPTS[0],
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        async def stream(i: int, http: httpx.AsyncClient) -> None:
            async with http.stream("POST", COMPLETIONS, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals[i].append(time.perf_counter())
                        started[i].set()

        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as http:
            streams = [asyncio.ensure_future(stream(i, http)) for i in range(8)]
            for event in started:
                await event.wait()
            t0 = time.perf_counter()
            long = await http.post(
                COMPLETIONS, json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 1}
            )
            t1 = time.perf_counter()
            assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == len(long_prompt)
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        return arrivals, t0, t1

    arrivals, t0, t1 = asyncio.run(main())
    bound = 3 * step_time + 0.2  # slack for a shared machine: the tiny model steps in milliseconds
    for times in arrivals:
        during = [t for t in times if t0 <= t <= t1]
        assert during, "the running streams got tokens while the long prompt was prefilled"
        window = [max(t for t in times if t < t0), *during]
        gap = max(b - a for a, b in zip(window, window[1:], strict=False))
        assert gap < bound, f"inter-token gap {gap:.3f}s > {bound:.3f}s (one full step: {step_time:.3f}s)"
    _assert_idle_and_empty(server)
