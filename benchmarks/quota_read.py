"""What a token quota costs: the ledger's read of a key's use in its period (once per key every 5 s, off the
request path, between the usage writer's writes), against the number of usage records the key has in the
period; and a decision answered from memory (hold, then release), per request.

The usage table is filled with `--records` records of one key in the current month, and a tenth as many of
other keys; the read (a SUM over the (key_id, created_at) index) is timed on SQLite and PostgreSQL, the median
of `--repeats` reads by fresh ledgers.

    python benchmarks/quota_read.py [--records 1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import insert

from llmserve.platform.keys import ApiKey
from llmserve.platform.quota import QuotaLedger
from llmserve.store.db import Database, open_database
from llmserve.store.schema import UsageRecordRow

KEY = ApiKey(id="key_heavy", name="heavy", prefix="", tier="default", rpm=None, tpm=None, models=None,
             is_admin=False, created_at=datetime.now(timezone.utc), revoked_at=None, token_quota=10**12,
             quota_period="month")


def fill(db: Database, records: int) -> None:
    month = datetime.now(timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    total = records + records // 10
    with db.session(write=True) as session:
        for start in range(0, total, 20_000):
            session.execute(insert(UsageRecordRow), [
                {"request_id": f"r{i}", "key_id": KEY.id if i < records else f"key_{i % 50}", "model": "m",
                 "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 0, "status": "completed",
                 "created_at": month + timedelta(seconds=i % 86_400)}
                for i in range(start, min(total, start + 20_000))
            ])


def read_ms(db: Database, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        ledger = QuotaLedger(db, None)
        started = time.perf_counter()
        state = asyncio.run(ledger.state(KEY))
        times.append((time.perf_counter() - started) * 1000)
        assert state is not None
    return statistics.median(times)


def decision_us(db: Database, decisions: int) -> float:
    ledger = QuotaLedger(db, None, refresh_seconds=3600)

    async def run() -> float:
        await ledger.state(KEY)
        started = time.perf_counter()
        for i in range(decisions):
            _, hold = await ledger.hold(KEY, 100)
            ledger.release(hold, f"d{i}", 0)
        return (time.perf_counter() - started) / decisions * 1e6

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.store.fixtures import postgres_schema, postgres_url

    print("| database | records of the key | read (ms, median) | decision from memory (us) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = open_database(f"sqlite:///{Path(tmp) / 'usage.db'}")
        fill(sqlite, args.records)
        print(f"| SQLite | {args.records:,} | {read_ms(sqlite, args.repeats):.1f} | {decision_us(sqlite, 100_000):.2f} |")
        sqlite.dispose()
    with postgres_schema() as schema:
        postgres = open_database(postgres_url(schema))
        fill(postgres, args.records)
        print(f"| PostgreSQL | {args.records:,} | {read_ms(postgres, args.repeats):.1f} | "
              f"{decision_us(postgres, 100_000):.2f} |")
        postgres.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
