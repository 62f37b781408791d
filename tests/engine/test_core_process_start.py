"""How an engine core process starts (core_client, core_bootstrap): forked from the forkserver, it takes on the
front end's environment of the moment it starts, OpenMP's thread count included (the forkserver loaded torch
with none), with OMP_WAIT_POLICY=PASSIVE for the processes it starts in turn."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from llmserve.engine import core_client
from llmserve.engine.core_bootstrap import run_in_environment


def _report(path: str) -> None:
    import torch

    facts = {"threads": torch.get_num_threads(), "mark": os.environ.get("LLMSERVE_TEST_MARK"),
             "wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    Path(path).write_text(json.dumps(facts))


def _start_core_like(path: Path) -> dict:
    """Run `_report` as a core is run: forked from the forkserver, in the environment a core is given."""
    call = pickle.dumps((_report, (str(path),)))
    process = core_client._forkserver().Process(target=run_in_environment, args=(core_client._core_environment(), call))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0
    return json.loads(path.read_text())


def _default_thread_count() -> int:
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    command = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    return int(subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout)


def test_each_process_takes_on_the_environment_and_thread_count_of_the_moment_it_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    core_client._forkserver()  # started (if it was not already) while the front end asks for one thread
    for threads, mark in (("3", "first"), ("1", "second")):
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        monkeypatch.setenv("LLMSERVE_TEST_MARK", mark)
        facts = _start_core_like(tmp_path / f"{mark}.json")
        assert facts == {"threads": int(threads), "mark": mark, "wait_policy": "PASSIVE"}
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _start_core_like(tmp_path / "default.json")["threads"] == _default_thread_count()
