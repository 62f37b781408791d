"""What the gateway's platform adds to each streamed event: the relay (gateway/relay.py) that reads the
replica's running usage, takes out the usage fields the client did not ask for, puts in the gateway's
response id and, with a safety filter, screens the text, against passing the same events through.

No network and no model: a replica's chat stream (a role chunk, `--tokens` one-token chunks with
`continuous_usage_stats`, a usage chunk, [DONE]) is fed to `StreamRelay.events` in memory, rounds
alternating between the pass-through, the relay and the relay with a safety filter; the median round
is reported in microseconds per event.

    python benchmarks/gateway_relay.py [--tokens 256] [--streams 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator

from llmserve.gateway.relay import RelayMeter, Reply, StreamRelay
from llmserve.platform.safety import OutputGuard, RuleSetFilter


def replica_stream(tokens: int) -> list[bytes]:
    """A replica's events, one relayed chunk each."""
    envelope = {"id": "chatcmpl-replica", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def event(choices: list[dict], completion: int) -> bytes:
        usage = {"prompt_tokens": 20, "completion_tokens": completion, "total_tokens": 20 + completion,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        body = {**envelope, "choices": choices, "usage": usage, "system_fingerprint": None}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    def choice(delta: dict, finish: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    events = [event([choice({"role": "assistant", "content": ""})], 0)]
    events += [event([choice({"content": " word"}, "length" if i == tokens else None)], i) for i in range(1, tokens + 1)]
    return [*events, event([], tokens), b"data: [DONE]\n\n"]


async def _chunks(events: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in events:
        yield chunk


async def _completed(reply: Reply) -> None:
    return None


async def run(events: list[bytes], streams: int, mode: str) -> float:
    """Seconds to push `streams` streams through `mode`: "pass", "relay" or "relay+safety"."""
    safety = RuleSetFilter(words=["forbidden"]) if mode == "relay+safety" else None
    started = time.perf_counter()
    for i in range(streams):
        if mode == "pass":
            async for _ in _chunks(events):
                pass
            continue
        meter = RelayMeter(None, f"chatcmpl-{i}", None, "m", None, 0)
        reply = Reply("content", 1, lambda: OutputGuard(safety, 32) if safety is not None else None)
        relay = StreamRelay(meter, reply, f"chatcmpl-{i}", include_usage=True, continuous_usage=False,
                            on_completed=_completed)
        async for _ in relay.events(_chunks(events)):
            pass
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    events = replica_stream(args.tokens)
    modes = ("pass", "relay", "relay+safety")
    timings: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            timings[mode].append(asyncio.run(run(events, args.streams, mode)))
    per_event = {mode: statistics.median(t) / (args.streams * len(events)) * 1e6 for mode, t in timings.items()}
    for mode in modes:
        print(f"{mode:>13}: {per_event[mode]:6.2f} µs/event (median of {args.rounds} rounds)")
    print(f"relay adds {per_event['relay'] - per_event['pass']:.2f} µs/event; "
          f"with safety {per_event['relay+safety'] - per_event['pass']:.2f} µs/event")


if __name__ == "__main__":
    main()
