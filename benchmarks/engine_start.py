"""How long an engine core takes to start (from `AsyncLLM.from_config` to ready) and to stop (`close`), forked
from the forkserver that loaded torch once (what llmserve does) against spawned afresh (what it did before), on
the built-in `--size` Llama (random weights), alternated round by round. The first forked start, which starts the
forkserver too, is reported apart. Both arms' OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE).

    python benchmarks/engine_start.py [--size tiny] [--rounds 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve.config import EngineConfig  # noqa: E402
from llmserve.engine import core_client  # noqa: E402
from llmserve.engine.async_llm import AsyncLLM  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402

FORKED = core_client._forkserver


def spawned() -> multiprocessing.context.BaseContext:
    return multiprocessing.get_context("spawn")


def start_and_stop(config: EngineConfig, context_of) -> tuple[float, float]:
    core_client._forkserver = context_of
    started = time.perf_counter()
    engine = AsyncLLM.from_config(config)
    ready = time.perf_counter()
    engine.close()
    return ready - started, time.perf_counter() - ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", arch="llama", size=args.size)
        config = EngineConfig(model=str(model), dtype="bfloat16", num_kv_blocks=64, max_model_len=512)
        first = start_and_stop(config, FORKED)
        arms: dict[str, list[tuple[float, float]]] = {"forked": [], "spawned": []}
        for _ in range(args.rounds):
            arms["spawned"].append(start_and_stop(config, spawned))
            arms["forked"].append(start_and_stop(config, FORKED))
    print(f"{args.size} Llama, {args.rounds} rounds alternated; median seconds")
    print(f"first forked (starts the forkserver): start {first[0]:.2f}, stop {first[1]:.2f}")
    for name, times in arms.items():
        start = statistics.median(t[0] for t in times)
        stop = statistics.median(t[1] for t in times)
        print(f"{name:8s} start {start:.2f}  stop {stop:.2f}  both {start + stop:.2f}")
    forked = [sum(t) for t in arms["forked"]]
    spawned_ = [sum(t) for t in arms["spawned"]]
    print(f"spawned / forked, start and stop: {statistics.median(spawned_) / statistics.median(forked):.2f}x")


if __name__ == "__main__":
    main()
