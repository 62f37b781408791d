"""What an engine core process runs first. Cores fork from multiprocessing's forkserver (core_client), which
loaded torch once (core_preload), when the first core started; so a core's environment is the server's of that
moment. It takes on the front end's environment of now before anything else, and only then unpickles what it is
to run, since some of llmserve's modules read their switches at import. For that reason this module imports none
of them.
"""

from __future__ import annotations

import os
import pickle
from typing import Any


def run_in_environment(environment: dict[str, str], pickled_call: bytes) -> Any:
    os.environ.clear()
    os.environ.update(environment)
    threads = _thread_count(environment.get("OMP_NUM_THREADS", ""))
    if threads:  # OpenMP read the variable when the forkserver loaded torch, which it loaded without one
        import torch

        torch.set_num_threads(threads)
    target, args = pickle.loads(pickled_call)
    return target(*args)


def _thread_count(value: str) -> int | None:
    first = value.split(",")[0].strip()  # OpenMP's nested form, "4,2": the outer level's count
    return int(first) if first.isdigit() and int(first) > 0 else None
