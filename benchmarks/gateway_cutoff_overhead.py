"""What the gateway's shutdown cut-off (`gateway/shutdown.py`) adds to each relayed event: a generator
of fixed chunks drained directly and through `StreamCutoff.guard`, alternated, CPU time per event.

    python benchmarks/gateway_cutoff_overhead.py [--events 200000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

from llmserve.gateway.shutdown import StreamCutoff

CHUNK = b'id: 1\ndata: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


async def source(events: int) -> AsyncIterator[bytes]:
    for _ in range(events):
        yield CHUNK


async def cpu_per_event(events: AsyncIterator[bytes], count: int) -> float:
    started = time.process_time()
    async for _ in events:
        pass
    return (time.process_time() - started) / count * 1e6


async def main(count: int, repeats: int) -> None:
    cutoff = StreamCutoff()
    for _ in range(repeats):
        plain = await cpu_per_event(source(count), count)
        guarded = await cpu_per_event(cutoff.guard(source(count)), count)
        print(f"plain {plain:.2f} us/event, guarded {guarded:.2f} us/event, added {guarded - plain:.2f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.events, args.repeats))
