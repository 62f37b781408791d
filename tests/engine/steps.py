"""Driving the scheduler without a model: each step's sampled tokens are given, and every change to
request and block state is the scheduler's own (`schedule` and `update_from_output`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.sequence import Request, Sequence
from llmserve.model.runner import ModelOutput
from llmserve.sampling.params import SamplingParams

_order = itertools.count()
UNLIMITED = SamplingParams(max_tokens=None)


def add(sched: Scheduler, tokens: int | Seq[int], priority: int = 0, params: SamplingParams = UNLIMITED,
        salt: str | None = None) -> Sequence:
    """Queue a request (`tokens` ids, or that many) and return its first sequence."""
    n = next(_order)
    ids = list(range(tokens)) if isinstance(tokens, int) else list(tokens)
    request = Request(f"r{n}", ids, params, seed=0, arrival_order=n, priority=priority,
                      cache_root=hash_root("m", salt))
    sched.add_request(request)
    return request.seqs[0]


def sampled(out: SchedulerOutput, token: int = 7) -> ModelOutput:
    """A model's answer to `out`: `token` for every sampling row."""
    return ModelOutput([token] * len(out.samples))


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One step, its samples applied before the next is scheduled (serial scheduling)."""
    out = sched.schedule()
    sched.update_from_output(out, sampled(out, token))
    return out


def scheduled(out: SchedulerOutput) -> dict[Sequence, int]:
    return {row.seq: row.num_new for row in out.rows}
