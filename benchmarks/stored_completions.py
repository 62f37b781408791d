"""What OpenAI's stored chat completions (`store: true`) cost as a key's store grows: keeping one
(`StoredCompletions.save`, before the client sees the end), reading one back, and listing a page of 20 (oldest first,
from the start and after the 100th, newest first, and filtered by model or by a metadata pair that one
completion in 100 holds, or that none holds: every one of the key's completions is read).

The key's completions are written in bulk up to each size (`--sizes`), each a 100-word reply to a 100-word
question with two metadata pairs; another key holds as many again, which its listings must pass over. Timings are
medians of `--repeats` calls.

    PYTHONPATH=. python benchmarks/stored_completions.py                       # a temporary SQLite file
    PYTHONPATH=. python benchmarks/stored_completions.py --database-url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete

from llmserve.platform.chat_completions import StoredCompletions, stored_messages
from llmserve.store.db import open_database
from llmserve.store.schema import ChatCompletionRow, utcnow

KEY, OTHER = "key_bench", "key_other"
WORDS = " ".join(["word"] * 100)


def _completion(completion_id: str, model: str) -> dict:
    return {"id": completion_id, "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": WORDS}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 130, "completion_tokens": 100, "total_tokens": 230}}


def _rows(key_id: str, start: int, count: int) -> list[ChatCompletionRow]:
    """`count` completions made one second apart from `start` seconds ago (so the newest are the last made)."""
    now = utcnow()
    rows = []
    for i in range(start, start + count):
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = "big" if i % 10 == 0 else "small"
        rows.append(ChatCompletionRow(
            id=completion_id, key_id=key_id, model=model, created_at=now - timedelta(seconds=10**7 - i),
            completion=_completion(completion_id, model),
            messages=stored_messages(completion_id, [{"role": "user", "content": WORDS}]),
            tags={"run": f"run-{i % 100}", "suite": "bench"}))
    return rows


def _cases(store: StoredCompletions, hundredth: str) -> dict[str, Callable[[], object]]:
    return {
        "save one": lambda: store.save(KEY, _completion(f"chatcmpl-{uuid.uuid4().hex}", "small"), [], {"run": "new"}),
        "get one": lambda: store.get(KEY, hundredth),
        "list 20, oldest first": lambda: store.list(KEY),
        "list 20 after the 100th": lambda: store.list(KEY, after=hundredth),
        "list 20, newest first": lambda: store.list(KEY, order="desc"),
        "list 20 of a model (1 in 10)": lambda: store.list(KEY, model="big"),
        "list 20 by metadata (1 in 100)": lambda: store.list(KEY, metadata={"run": "run-7"}),
        "list by metadata that none holds": lambda: store.list(KEY, metadata={"run": "nowhere"}),
    }


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("--sizes", default="1000,10000,100000", help="the key's stored completions at each measure")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        database = open_database(args.database_url or f"sqlite:///{Path(tmp) / 'bench.db'}")
        store = StoredCompletions(database)
        with database.session(write=True) as session:
            session.execute(delete(ChatCompletionRow))
        sizes = [int(size) for size in args.sizes.split(",")]
        print("| ms | " + " | ".join(f"{size:,} stored" for size in sizes) + " |")
        print("|---" * (len(sizes) + 1) + "|")
        results: dict[str, list[float]] = {}
        written = 0
        try:
            for size in sizes:
                for key_id in (KEY, OTHER):
                    for start in range(written, size, 5000):
                        with database.session(write=True) as session:
                            session.add_all(_rows(key_id, start, min(5000, size - start)))
                written = size
                cases = _cases(store, store.list(KEY, limit=100)[0][-1]["id"])
                for name, call in cases.items():
                    results.setdefault(name, []).append(_median_ms(call, args.repeats))
        finally:
            with database.session(write=True) as session:
                session.execute(delete(ChatCompletionRow))
            database.dispose()
        for name, values in results.items():
            print(f"| {name} | " + " | ".join(f"{value:.2f}" for value in values) + " |")


if __name__ == "__main__":
    main()
