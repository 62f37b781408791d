"""What a resumable stream adds per event on the API server's event loop: events pass through a
producer task, a buffer and a follower instead of straight from the pipeline's generator to the
response. Both sides read the same pre-built chat chunks from a source that yields to the loop
between events (as the engine's outputs arrive one step at a time); alternated A/B, repeated.

    PYTHONPATH=. python benchmarks/stream_resume_overhead.py [--events 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator

from llmserve.server.streaming import EventIds, StreamRegistry

CHUNK = (
    'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1700000000,'
    '"model":"tiny-llama","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,'
    '"finish_reason":null}]}\n\n'
)


async def source(count: int) -> AsyncIterator[str]:
    numbered = EventIds()
    for _ in range(count):
        await asyncio.sleep(0)  # the next engine output arrives on a later turn of the loop
        yield numbered(CHUNK)


async def plain(count: int) -> int:
    sent = 0
    async for event in source(count):
        sent += len(event)
    return sent


async def resumable(count: int) -> int:
    stream = StreamRegistry().open("chatcmpl-bench", None, source(count))
    sent = 0
    async for event in stream.follow():
        sent += len(event)
    return sent


def timed(run, count: int) -> float:
    start = time.perf_counter()
    asyncio.run(run(count))
    return (time.perf_counter() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"plain": [], "resumable": []}
    for _ in range(args.repeats):
        for name, run in (("plain", plain), ("resumable", resumable)):
            results[name].append(timed(run, args.events))
    base, resumed = (statistics.median(results[name]) for name in ("plain", "resumable"))
    for name, times in results.items():
        print(f"{name:10s} median {statistics.median(times):6.2f} us/event  (runs: {', '.join(f'{t:.2f}' for t in times)})")
    print(f"resumable / plain: {resumed / base:.2f}x, +{resumed - base:.2f} us per event")


if __name__ == "__main__":
    main()
