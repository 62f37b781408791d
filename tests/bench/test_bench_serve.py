"""`llmserve bench serve` end to end against an in-process fake OpenAI-compatible server."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from llmserve.bench.cli import main as bench_main
from llmserve.bench.client import join_url
from llmserve.bench.datasets import (
    Conversation,
    LocalTokenizerSource,
    Turn,
    WordSource,
    completion_prompt,
    multi_turn_dataset,
    parse_len_range,
)
from tests.bench.fake_server import FakeState, run_fake_server


def run_bench(tmp_path: Path, base_url: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "result.json"
    argv = ["serve", "--base-url", base_url, "--no-progress", "--seed", "1", "--result-json", str(out), *extra]
    assert bench_main(argv) == 0
    return json.loads(out.read_text())


def test_random_dataset_counts_and_lengths(tmp_path: Path) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--num-prompts", "6", "--request-rate", "50",
                        "--random-input-len-range", "8:16", "--random-output-len-range", "3:6",
                        "--slo", "ttft=5000,tpot=5000", "--save-detailed")
    assert doc["model"] == "fake-model" and doc["token_source"] == "server"
    (run,) = doc["runs"]
    assert (run["num_requests"], run["completed"], run["failed"]) == (6, 6, 0)
    assert len(state.requests) == 6
    for body in state.requests:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and "min_tokens" not in body
        assert 3 <= body["max_tokens"] <= 6
        assert 8 <= len(body["prompt"].split()) <= 16  # the server's /tokenize counts words: exact fit
    assert run["total_output_tokens"] == sum(b["max_tokens"] for b in state.requests)
    assert run["goodput"]["good_requests"] == 6 and run["goodput"]["percent"] == 100.0
    assert run["ttft_ms"]["count"] == 6 and run["itl_ms"]["count"] == run["total_output_tokens"] - 6
    assert all(r["output_tokens"] == len(r["itl"]) + 1 for r in run["requests"])


def test_lora_modules_spread_the_requests_over_the_adapters(tmp_path: Path) -> None:
    """vLLM's --lora-modules: each request names one of the adapters, drawn by the seed (the fake server answers
    to any name); one at a time, so the requests arrive in order."""
    args = ("--num-prompts", "12", "--random-input-len-range", "4", "--random-output-len-range", "2",
            "--lora-modules", "sql", "poet", "--max-concurrency", "1")
    names = []
    for _ in range(2):
        state = FakeState()
        with run_fake_server(state) as url:
            doc = run_bench(tmp_path, url, *args)
        assert doc["lora_modules"] == ["sql", "poet"] and doc["runs"][0]["completed"] == 12
        names.append([body["model"] for body in state.requests])
    assert set(names[0]) == {"sql", "poet"}
    assert names[1] == names[0]  # the same seed, the same draw


def test_rate_sweep_and_failures_are_counted(tmp_path: Path) -> None:
    state = FakeState(reject_every=3)
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--num-prompts", "6", "--request-rate", "100,inf",
                        "--random-input-len-range", "4", "--random-output-len-range", "2",
                        "--max-concurrency", "2", "--exact-output-len")
    assert [run["request_rate"] for run in doc["runs"]] == [100.0, "inf"]
    assert len(state.requests) == 12
    assert all(body["min_tokens"] == body["max_tokens"] == 2 for body in state.requests)
    for run in doc["runs"]:
        assert (run["completed"], run["failed"], run["rate_limited_429"]) == (4, 2, 2)
        assert run["max_concurrency"] == 2


def test_shared_prefix_dataset(tmp_path: Path) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--dataset", "shared-prefix", "--num-prompts", "6",
                        "--shared-prefix-len", "40", "--question-len", "5", "--output-len", "4")
    (run,) = doc["runs"]
    assert run["completed"] == 6
    prompts = [body["prompt"] for body in state.requests]
    prefixes = {p.split("\n")[0] for p in prompts}
    questions = {p.split("\n")[1] for p in prompts}
    assert len(prefixes) == 1 and len(next(iter(prefixes)).split()) == 40
    assert len(questions) == 6
    assert run["total_output_tokens"] == 24


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_multi_turn_sends_replies_back(tmp_path: Path, endpoint: str) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--dataset", "multi-turn", "--endpoint", endpoint, "--num-prompts", "3",
                        "--num-turns", "2", "--turn-input-len", "6", "--turn-output-len", "3",
                        "--request-rate", "inf")
    (run,) = doc["runs"]
    assert (run["num_requests"], run["completed"]) == (6, 6)
    assert set(run["per_turn_ttft_ms"]) == {"0", "1"}
    assert run["per_turn_ttft_ms"]["1"]["count"] == 3
    replies = {i + 1: "".join(f" r{i + 1}t{t}" for t in range(3)) for i in range(len(state.requests))}
    later = 0
    for request_id, body in enumerate(state.requests, start=1):
        if endpoint.endswith("chat/completions"):
            roles = [m["role"] for m in body["messages"]]
            if roles == ["user"]:
                continue
            assert roles == ["user", "assistant", "user"]
            earlier = body["messages"][1]["content"]
            first_user = body["messages"][0]["content"]
        else:
            if body["prompt"].count("User:") == 1:
                continue
            assert body["prompt"].count("User:") == 2
            first_user = body["prompt"].split("\nAssistant:")[0].removeprefix("User: ")
            earlier = body["prompt"].split("\nAssistant:")[1].split("\nUser:")[0]
        later += 1
        # The reply is the fake server's actual answer to this conversation's first turn.
        first = next(i for i, b in enumerate(state.requests, start=1) if _first_user(b) == first_user)
        assert first < request_id
        assert earlier == replies[first]
    assert later == 3


def _first_user(body: dict[str, Any]) -> str:
    if "messages" in body:
        return body["messages"][0]["content"]
    return body["prompt"].split("\nAssistant:")[0].removeprefix("User: ")


def test_word_fallback_without_tokenize(tmp_path: Path) -> None:
    state = FakeState(with_tokenize=False)
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--num-prompts", "3", "--random-input-len-range", "5:7",
                        "--random-output-len-range", "2", "--model", "fake-model", "--num-warmups", "1")
    assert doc["token_source"] == "words"
    assert doc["runs"][0]["completed"] == 3
    assert len(state.requests) == 4  # one warmup
    assert all(5 <= len(b["prompt"].split()) <= 7 for b in state.requests[1:])


def test_local_tokenizer_and_token_id_prompts(tmp_path: Path, tiny_llama_dir: Path) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--num-prompts", "4", "--tokenizer", str(tiny_llama_dir),
                        "--prompt-format", "ids", "--random-input-len-range", "10:12",
                        "--random-output-len-range", "2")
    assert doc["token_source"] == "local" and doc["runs"][0]["completed"] == 4
    for body in state.requests:
        assert isinstance(body["prompt"], list) and 10 <= len(body["prompt"]) <= 12
        assert all(isinstance(t, int) for t in body["prompt"])


def test_local_tokenizer_text_prompts_have_exact_lengths(tiny_llama_dir: Path) -> None:
    import random

    from llmserve.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    source = LocalTokenizerSource(tokenizer)
    rng = random.Random(0)
    for length in (1, 7, 64, 300):
        text, measured = source.text(length, rng)
        assert measured == length == len(tokenizer.encode(text, add_special_tokens=False))


def test_plot_from_result_jsons(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--num-prompts", "3", "--request-rate", "20,inf",
                        "--random-input-len-range", "4", "--random-output-len-range", "3",
                        "--slo", "ttft=1000,tpot=100", "--plot", str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").stat().st_size > 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**doc, "label": "other"}))
    out = tmp_path / "both.png"
    assert bench_main(["plot", str(tmp_path / "result.json"), str(other), "--labels", "ours,baseline",
                       "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_top_level_cli_dispatches_bench(capsys: pytest.CaptureFixture[str]) -> None:
    from llmserve.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    assert "--request-rate" in capsys.readouterr().out


def test_helpers() -> None:
    assert parse_len_range("32:512") == (32, 512) and parse_len_range("7") == (7, 7)
    with pytest.raises(ValueError):
        parse_len_range("9:3")
    assert join_url("http://h:1/v1/", "/v1/completions") == "http://h:1/v1/completions"
    assert join_url("http://h:1", "v1/chat/completions") == "http://h:1/v1/chat/completions"
    conversation = Conversation([Turn("hi there", 2, 4), Turn("and then", 2, 4)])
    first = completion_prompt(conversation, 0, [])
    second = completion_prompt(conversation, 1, [" ok fine"])
    assert second.startswith(first + " ok fine\n")  # each turn extends the previous prompt verbatim
    assert WordSource().count("a b  c") == 3


def test_multi_turn_reply_lengths_can_vary_per_turn(tmp_path: Path) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        run_bench(tmp_path, url, "--dataset", "multi-turn", "--endpoint", "/v1/chat/completions",
                  "--num-prompts", "4", "--num-turns", "3", "--turn-input-len", "6", "--turn-output-len", "2:9",
                  "--request-rate", "inf")
    lengths = [body["max_tokens"] for body in state.requests]
    assert len(lengths) == 12 and all(2 <= n <= 9 for n in lengths)
    assert len(set(lengths)) > 1


def test_multi_turn_with_shared_system_prompt_and_first_turn_context(tmp_path: Path) -> None:
    state = FakeState()
    with run_fake_server(state) as url:
        run_bench(tmp_path, url, "--dataset", "multi-turn", "--endpoint", "/v1/chat/completions",
                  "--num-prompts", "3", "--num-turns", "2", "--turn-input-len", "6", "--turn-output-len", "2",
                  "--system-prompt-len", "8", "--first-turn-context-len", "20:30", "--request-rate", "inf")
    assert len(state.requests) == 6
    systems = {body["messages"][0]["content"] for body in state.requests}
    assert len(systems) == 1 and all(body["messages"][0]["role"] == "system" for body in state.requests)
    assert len(systems.pop().split()) == 8
    first_turns = [body["messages"] for body in state.requests if len(body["messages"]) == 2]
    later_turns = [body["messages"] for body in state.requests if len(body["messages"]) == 4]
    assert len(first_turns) == len(later_turns) == 3
    openers = {messages[1]["content"] for messages in first_turns}
    assert len(openers) == 3  # each conversation opens with a context of its own
    assert all(26 <= len(text.split()) <= 36 for text in openers)  # 20-30 words of context + the 6-word question
    for messages in later_turns:
        assert messages[1]["content"] in openers  # the history repeats the opener verbatim
        assert len(messages[3]["content"].split()) == 6  # later user turns are short


def test_multi_turn_rejects_a_negative_system_prompt(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="system-prompt-len"):
        multi_turn_dataset(WordSource(), 1, 2, 6, 2, "text", random.Random(0), system_prompt_len=-1)


def test_random_mm_sends_each_request_its_own_images_before_its_text(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's random-mm: chat messages of `--images-per-request` PNG data: URLs of `--image-size`, then the text;
    the completions endpoint is refused."""
    import base64
    import io

    from PIL import Image

    state = FakeState()
    with run_fake_server(state) as url:
        doc = run_bench(tmp_path, url, "--dataset", "random-mm", "--endpoint", "/v1/chat/completions",
                        "--num-prompts", "3", "--random-input-len-range", "4", "--random-output-len-range", "2",
                        "--images-per-request", "2", "--image-size", "40x30")
        assert doc["runs"][0]["completed"] == 3
        refused = bench_main(["serve", "--base-url", url, "--no-progress", "--dataset", "random-mm", "--num-prompts", "1"])
        assert refused == 2 and "--endpoint /v1/chat/completions" in capsys.readouterr().err
    urls = []
    for body in state.requests:
        (message,) = body["messages"]
        parts = message["content"]
        assert [part["type"] for part in parts] == ["image_url", "image_url", "text"]
        assert len(parts[2]["text"].split()) == 4
        urls += [part["image_url"]["url"] for part in parts[:2]]
    assert len(set(urls)) == 6  # each request's own: no cache hits
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].removeprefix("data:image/png;base64,"))))
    assert image.size == (40, 30)
