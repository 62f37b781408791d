"""What sharing resumable streams through Redis (server/shared_streams.py, `--redis-url`) costs and gives: the CPU
time the producing process spends per event with the copy into Redis against without it (a follower in the producing
process each, reading the buffer), and how late a follower in another process (reading the copy) gets each event
against that follower (the third arm adds one elsewhere per stream; its CPU counts both processes').

Workload: `--streams` resumable streams at once, each `--events` events of a chat chunk's size (about 200
characters: `id: N` and a `chat.completion.chunk` with one token), one every `--interval-ms` (a decode step: the
copy batches what came since its last write, so its cost per event depends on the rate). Two registries stand for
two processes sharing the Redis at `--redis-url`; each arm runs `--rounds` times, the arms alternating.

    PYTHONPATH=. python benchmarks/shared_streams.py [--streams 64] [--events 200] [--interval-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
import uuid
from collections.abc import AsyncIterator

import redis

from llmserve.server.shared_streams import StreamMirror
from llmserve.server.streaming import ResumeLimits, StreamRegistry

CHUNK = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk", "created": 1764900000,
         "model": "llmserve-default", "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}]}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _events(count: int, interval_s: float) -> AsyncIterator[str]:
    for number in range(count):
        yield f"id: {number}\ndata: {json.dumps({**CHUNK, 'sent': time.perf_counter()})}\n\n"
        await asyncio.sleep(interval_s)
    yield f"id: {count}\ndata: [DONE]\n\n"


async def _delays(events: AsyncIterator[str]) -> list[float]:
    delays = []
    async for event in events:
        data = event.split("data: ", 1)[1].strip()
        if data != "[DONE]":
            payload = json.loads(data)
            if "sent" not in payload:
                raise RuntimeError(f"not an event of the stream: {data}")
            delays.append(time.perf_counter() - payload["sent"])
    return delays


async def _round(args: argparse.Namespace, shared: bool, follow_elsewhere: bool, prefix: str) -> dict[str, float]:
    limits = ResumeLimits()
    mirrors = [StreamMirror(args.redis_url, limits, prefix) if shared else None for _ in range(2)]
    here, there = (StreamRegistry(limits, mirror) for mirror in mirrors)
    ids = [uuid.uuid4().hex for _ in range(args.streams)]
    cpu = _cpu_s()
    streams = [here.open(stream_id, None, _events(args.events, args.interval_ms / 1000)) for stream_id in ids]
    followers = [asyncio.ensure_future(_delays(stream.follow())) for stream in streams]
    remote = []
    if follow_elsewhere:
        await asyncio.sleep(0.05)  # the copies' first writes
        remote = [asyncio.ensure_future(_delays((await there.get(stream_id, None)).follow())) for stream_id in ids]
    local_delays = [d for delays in await asyncio.gather(*followers) for d in delays]
    remote_delays = [d for delays in await asyncio.gather(*remote) for d in delays]
    await asyncio.gather(*(stream.wait_finished() for stream in streams))
    used = _cpu_s() - cpu
    await here.close()
    await there.close()
    result = {"cpu_s": used, "local_p50_ms": 1000 * statistics.median(local_delays),
              "local_p99_ms": 1000 * statistics.quantiles(local_delays, n=100)[98]}
    if remote_delays:
        result |= {"remote_p50_ms": 1000 * statistics.median(remote_delays),
                   "remote_p99_ms": 1000 * statistics.quantiles(remote_delays, n=100)[98]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    prefix = f"llmserve-bench:{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(args.redis_url)
    arms = {"buffer only": (False, False), "copied into Redis": (True, False),
            "copied, and followed elsewhere": (True, True)}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for round_number in range(args.rounds):
        order = list(arms) if round_number % 2 == 0 else list(reversed(arms))  # alternate which arm goes first
        for name in order:
            results[name].append(asyncio.run(_round(args, *arms[name], prefix)))
    left = list(client.scan_iter(f"{prefix}*"))
    client.close()
    events = args.streams * args.events
    print(f"{args.streams} streams x {args.events} events, one every {args.interval_ms:g} ms, {args.rounds} rounds")
    for name, rows in results.items():
        cpu_us = statistics.median(r["cpu_s"] for r in rows) / events * 1e6
        line = (f"{name:31} CPU {cpu_us:6.1f} us/event; follower here p50 "
                f"{statistics.median(r['local_p50_ms'] for r in rows):.2f} ms, p99 "
                f"{statistics.median(r['local_p99_ms'] for r in rows):.2f} ms")
        if "remote_p50_ms" in rows[0]:
            line += (f"; follower elsewhere p50 {statistics.median(r['remote_p50_ms'] for r in rows):.2f} ms, p99 "
                     f"{statistics.median(r['remote_p99_ms'] for r in rows):.2f} ms")
        print(line)
    ratios = [c["cpu_s"] / b["cpu_s"] for c, b in zip(results["copied into Redis"], results["buffer only"], strict=True)]
    print(f"CPU copied / buffer only, per round: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"keys in Redis after the rounds (finished streams, expiring a grace period after their end): {len(left)}")


if __name__ == "__main__":
    main()
