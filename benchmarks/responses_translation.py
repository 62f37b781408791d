"""What `/v1/responses` and `/v1/messages` add per streamed token on the API server's event loop: chat's chunks
are parsed and re-emitted as the Responses API's events (`responses_api`) or Anthropic's (`anthropic_api`, here
with two stop sequences, whose text is held back), against the chat chunks passed on as they are. Both read the same pre-built chat chunks from a source that yields to the loop between chunks (as
the engine's outputs arrive one step at a time); alternated A/B, repeated.

    PYTHONPATH=. python benchmarks/responses_translation.py [--tokens 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator

from llmserve.server.anthropic_api import MessageEvents
from llmserve.server.responses_output import ResponseEvents
from llmserve.server.responses_protocol import ResponsesRequest
from llmserve.server.streaming import EventIds

HEAD = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1700000000, "model": "tiny-llama"}
ROLE = json.dumps({**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
TOKEN = json.dumps({**HEAD, "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None, "finish_reason": None}]})
LAST = json.dumps({**HEAD, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
USAGE = json.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


async def source(tokens: int) -> AsyncIterator[str]:
    numbered = EventIds()
    yield numbered(f"data: {ROLE}\n\n")
    for _ in range(tokens):
        await asyncio.sleep(0)  # the next engine output arrives on a later turn of the loop
        yield numbered(f"data: {TOKEN}\n\n")
    for data in (LAST, USAGE, "[DONE]"):
        yield numbered(f"data: {data}\n\n")


async def chat(tokens: int) -> int:
    return sum([len(event) async for event in source(tokens)])


async def responses(tokens: int) -> int:
    body = ResponsesRequest(model="tiny-llama", input="hi", stream=True)
    return sum([len(event) async for event in ResponseEvents(body, "resp_bench").events(source(tokens))])


async def messages(tokens: int) -> int:
    events = MessageEvents("msg_bench", ["\n\nHuman:", "</answer>"]).events(source(tokens))
    return sum([len(event) async for event in events])


def timed(run, tokens: int) -> float:
    start = time.perf_counter()
    asyncio.run(run(tokens))
    return (time.perf_counter() - start) / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs = {"chat chunks passed on": chat, "Responses events": responses, "Anthropic events": messages}
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            results[name].append(timed(run, args.tokens))
    for name, values in results.items():
        print(f"{name:24s} {statistics.median(values):6.2f} us a token (min {min(values):.2f}, max {max(values):.2f})")
    base = statistics.median(results["chat chunks passed on"])
    for name in ("Responses events", "Anthropic events"):
        print(f"added by the translation to {name}: {statistics.median(results[name]) - base:.2f} us a token")


if __name__ == "__main__":
    main()
