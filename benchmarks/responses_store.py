"""What keeping Responses API responses costs a request: storing one (`ResponseStore.save`, on a worker thread
after the answer is made) and reading the conversation a `previous_response_id` continues (`context`, before
the chat completion starts), whose chain is walked back one turn at a time.

Each turn holds one user message and one assistant message of `--words` words. Timings are medians of
`--repeats` calls, alternated between the chain lengths.

    PYTHONPATH=. python benchmarks/responses_store.py                       # a temporary SQLite file
    PYTHONPATH=. python benchmarks/responses_store.py --database-url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import delete

from llmserve.platform.responses import ResponseStore, with_ids
from llmserve.store.db import open_database
from llmserve.store.schema import ResponseRow


def _response(response_id: str, text: str) -> dict:
    return {"id": response_id, "object": "response", "model": "bench", "status": "completed",
            "output": [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--lengths", default="1,10,100,1000", help="chain lengths (turns) to continue")
    ap.add_argument("--words", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        url = args.database_url or f"sqlite:///{Path(directory) / 'bench.db'}"
        database = open_database(url)
        store = ResponseStore(database)
        text = " ".join(["word"] * args.words)
        run = uuid.uuid4().hex[:8]
        lengths = [int(n) for n in args.lengths.split(",")]
        heads: dict[int, str] = {}
        previous = None
        for turn in range(1, max(lengths) + 1):  # one chain; each length continues its turn
            response_id = f"resp_bench_{run}_{turn}"
            store.save("key_bench", _response(response_id, text), with_ids([{"role": "user", "content": text}]),
                       previous)
            previous = response_id
            if turn in lengths:
                heads[turn] = response_id
        save_ms, context_ms = [], {n: [] for n in lengths}
        for i in range(args.repeats):
            start = time.perf_counter()
            store.save("key_bench", _response(f"resp_bench_{run}_x{i}", text), with_ids([{"role": "user",
                                                                                          "content": text}]), None)
            save_ms.append((time.perf_counter() - start) * 1e3)
            for n in lengths:
                start = time.perf_counter()
                items = store.context("key_bench", heads[n])
                context_ms[n].append((time.perf_counter() - start) * 1e3)
                assert len(items) == 2 * n
        with database.session(write=True) as session:
            session.execute(delete(ResponseRow).where(ResponseRow.id.like(f"resp_bench_{run}_%")))
        database.dispose()
    print(f"database: {url.split('://')[0]}, {args.words} words a message, median of {args.repeats}")
    print(f"| save one response | {statistics.median(save_ms):.2f} ms |")
    for n in lengths:
        print(f"| context of a {n}-turn chain | {statistics.median(context_ms[n]):.2f} ms |")


if __name__ == "__main__":
    main()
