"""Tensor parallelism: which shard of the model this process holds, and the collectives between the shards.

Megatron's split, as vLLM shards Llama: a rank holds 1/N of every attention's query and key/value heads (the
qkv projection's output rows, the o projection's input columns; with fewer key/value heads than ranks, the one its
query heads read) and 1/N of every MLP's intermediate features
(gate/up's output rows, down's input columns); the o and down projections' partial sums are added over the ranks
(`all_reduce`), so every rank ends each layer with the whole hidden state. Embeddings, norms and the language-model
head are whole on every rank, so each computes the same logits and samples the same tokens (a request's sampling
is seeded per step), and no sampled token crosses between ranks.

One process group per process, set by `init` before the model is built; without it the model is whole (rank 0 of 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmserve.model import shm_all_reduce
from llmserve.model.shm_all_reduce import SharedMemoryAllReduce

COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a rank gone (killed, out of memory) fails the others' step at most then


@dataclass(frozen=True)
class ParallelSetup:
    rank: int
    world_size: int
    init_method: str  # where the ranks meet: tcp://127.0.0.1:PORT


@dataclass
class _Group:
    rank: int = 0
    size: int = 1
    control: Any = None  # a gloo group for Python objects (the step batches), whatever the device's backend
    shared_memory: SharedMemoryAllReduce | None = None  # CPU ranks: small all-reduces through shared memory


_group = _Group()


def init(setup: ParallelSetup, device: torch.device, peers_alive: Callable[[], bool] = lambda: True) -> None:
    """Join the ranks: NCCL over CUDA devices (one each, by rank), gloo on CPU, where small all-reduces go through
    shared memory (`peers_alive` tells a rank waiting there whether the others live); objects always over gloo."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if torch.cuda.device_count() < setup.world_size:
            raise ValueError(f"Tensor parallelism over {setup.world_size} ranks needs {setup.world_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible.")
        torch.cuda.set_device(setup.rank)
    dist.init_process_group(backend, init_method=setup.init_method, rank=setup.rank, world_size=setup.world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    _group.rank, _group.size, _group.control = setup.rank, setup.world_size, control
    if device.type == "cpu":  # the ranks share the machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // setup.world_size))
        if shm_all_reduce.available():
            _group.shared_memory = _open_shared_memory(peers_alive)


def _open_shared_memory(peers_alive: Callable[[], bool]) -> SharedMemoryAllReduce:
    """Rank 0 makes the segment and names it to the others; once all have it mapped, its name goes."""
    path = broadcast(SharedMemoryAllReduce.create(_group.size) if _group.rank == 0 else None)
    try:
        shared = SharedMemoryAllReduce(_group.rank, _group.size, path, peers_alive)
        dist.barrier(group=_group.control)
    finally:
        if _group.rank == 0:
            path.unlink(missing_ok=True)
    return shared


def close() -> None:
    if _group.shared_memory is not None:
        _group.shared_memory.close()
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group.rank, _group.size, _group.control, _group.shared_memory = 0, 1, None, None


def rank() -> int:
    return _group.rank


def size() -> int:
    return _group.size


def shard(total: int, what: str) -> int:
    """This rank's share of `total` (heads, features), which the ranks must divide evenly."""
    if total % _group.size:
        raise ValueError(f"tensor parallelism over {_group.size} ranks needs {what} divisible by {_group.size}, "
                         f"got {total}.")
    return total // _group.size


def shard_kv_heads(total: int) -> int:
    """This rank's key/value heads: its share, or with fewer heads than ranks (MQA, GQA split wide) one head,
    the one its query heads read (`kv_head`)."""
    if total >= _group.size:
        return shard(total, "the key/value heads")
    if _group.size % total:
        raise ValueError(f"tensor parallelism over {_group.size} ranks needs the key/value heads ({total}) to divide "
                         f"{_group.size} when there are fewer of them.")
    return 1


def kv_head(total: int) -> int:
    """With fewer key/value heads than ranks, the one this rank holds (replicated on total/ranks ranks)."""
    return _group.rank * total // _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (every rank gets the same bits)."""
    if _group.size == 1:
        return x
    if _group.shared_memory is not None and _group.shared_memory.fits(x):
        return _group.shared_memory(x)
    dist.all_reduce(x)
    return x


def all_min(value: int) -> int:
    """The smallest of each rank's `value` (the KV blocks every rank has memory for)."""
    if _group.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_group.control)
    return int(tensor.item())


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (pickled over the control group)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=_group.control)
    return holder[0]


def gather(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0; None on the others (pickled over the control group)."""
    gathered = [None] * _group.size if _group.rank == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=_group.control)
    return gathered


def scatter(objs: list[Any] | None = None) -> Any:
    """Rank 0's `objs[r]` on each rank r (pickled over the control group)."""
    holder = [None]
    dist.scatter_object_list(holder, objs, src=0, group=_group.control)
    return holder[0]


@contextmanager
def alone() -> Iterator[None]:
    """This rank as if it were the only one: a model built or run inside is whole and reduces nothing (a
    speculative decoding draft model on rank 0, beside the split served model)."""
    saved = _group.rank, _group.size
    _group.rank, _group.size = 0, 1
    try:
        yield
    finally:
        _group.rank, _group.size = saved
