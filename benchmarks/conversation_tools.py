"""What a stored conversation's tool calls cost the turn that continues it: reading its active branch from the store
(`ConversationStore.history`) and turning it into the chat messages the template takes (`chat_history`: each call
joins the assistant message before it), for conversations of agent-like turns (a question, a function call, its
output, an answer: four stored messages a turn) against conversations of as many plain messages.

Every message's text is 50 words, a call's arguments a 50-word JSON string. Timings are medians of `--repeats`
reads; the read is what `conversation_id` (chat) or `conversation` (Responses) adds before a turn is templated.

    PYTHONPATH=. python benchmarks/conversation_tools.py                       # a temporary SQLite file
    PYTHONPATH=. python benchmarks/conversation_tools.py --database-url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import timeit
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from llmserve.platform.conversations import ConversationLimits, ConversationStore
from llmserve.server.conversation_items import chat_history
from llmserve.store.db import open_database

KEY = "key_bench"
WORDS = " ".join(["word"] * 50)
BATCH = 100  # messages written by one extend


def _agent_turn(i: int) -> list[dict]:
    call_id = f"call_{i}"
    return [{"role": "user", "content": WORDS},
            {"role": "assistant", "content": "", "tool_call": {"call_id": call_id, "name": "lookup",
                                                               "arguments": json.dumps({"query": WORDS})}},
            {"role": "tool", "content": WORDS, "tool_call_id": call_id},
            {"role": "assistant", "content": WORDS}]


def _plain_turn(i: int) -> list[dict]:
    return [{"role": "user" if j % 2 == 0 else "assistant", "content": WORDS} for j in range(4)]


def _conversation(store: ConversationStore, size: int, turn: Callable[[int], list[dict]]) -> str:
    conversation = store.create(KEY).id
    messages = [message for i in range(size // 4) for message in turn(i)]
    for start in range(0, len(messages), BATCH):
        store.extend(KEY, conversation, messages[start:start + BATCH])
    return conversation


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    return statistics.median(timeit.repeat(call, number=1, repeat=repeats)) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="default: a temporary SQLite file")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        url = args.database_url or f"sqlite:///{Path(directory) / 'bench.db'}"
        database = open_database(url)
        store = ConversationStore(database, ConversationLimits(max_messages=max(args.sizes)))
        print(f"database: {database.engine.url.get_backend_name()}; median of {args.repeats} reads, ms")
        print("| messages | plain: read | agent turns: read | agent turns: read + chat_history | chat messages |")
        print("|---|---|---|---|---|")
        try:
            for size in args.sizes:
                plain = _conversation(store, size, _plain_turn)
                agent = _conversation(store, size, _agent_turn)
                plain_ms = _median_ms(lambda: store.history(KEY, plain), args.repeats)  # noqa: B023
                agent_ms = _median_ms(lambda: store.history(KEY, agent), args.repeats)  # noqa: B023
                both_ms = _median_ms(lambda: chat_history(store.history(KEY, agent)), args.repeats)  # noqa: B023
                messages = len(chat_history(store.history(KEY, agent)))
                print(f"| {size:,} | {plain_ms:.1f} | {agent_ms:.1f} | {both_ms:.1f} | {messages:,} |")
                store.delete(KEY, plain)
                store.delete(KEY, agent)
                store.purge(timedelta(0))
        finally:
            database.dispose()


if __name__ == "__main__":
    main()
