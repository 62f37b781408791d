"""Tensor parallelism's collectives between two real processes (model/parallel.py): a small all-reduce through
shared memory and a large one through gloo give every rank the same sum, many calls in a row (the shared buffers
reused), and a rank waiting in shared memory for one that will never come stops once told the others are gone."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from llmserve.model import parallel, shm_all_reduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.available(), reason="no shared memory all-reduce here")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(rank: int, port: int, results: multiprocessing.Queue) -> None:
    parallel.init(parallel.ParallelSetup(rank, 2, f"tcp://127.0.0.1:{port}"), torch.device("cpu"))
    sums = []
    for call in range(50):  # the two buffers taken in turn, 25 times each
        small = torch.full((3, 64), float(rank + 1) * (call + 1), dtype=torch.bfloat16)
        assert parallel._group.shared_memory.fits(small)
        sums.append(parallel.all_reduce(small).float().unique().tolist())
    large = torch.arange(400_000, dtype=torch.float32) * (rank + 1)  # 1.6 MB: past a shared-memory slot
    assert not parallel._group.shared_memory.fits(large)
    parallel.all_reduce(large)
    results.put((rank, sums, torch.equal(large, torch.arange(400_000, dtype=torch.float32) * 3)))
    parallel.close()


def test_two_ranks_get_the_same_sums() -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    got = dict((rank, (sums, large_ok)) for rank, sums, large_ok in (results.get(timeout=120) for _ in ranks))
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected = [[3.0 * (call + 1)] for call in range(50)]
    assert got[0] == got[1] == (expected, True)


def lone_rank_main(rank: int, port: int, left: multiprocessing.Queue, results: multiprocessing.Queue) -> None:
    alive = [True]
    parallel.init(parallel.ParallelSetup(rank, 2, f"tcp://127.0.0.1:{port}"), torch.device("cpu"),
                  peers_alive=lambda: alive[0])
    if rank == 1:
        left.put("rank 1 leaves")  # never joins the all-reduce
        return
    assert left.get(timeout=60) == "rank 1 leaves"
    alive[0] = False  # as rank 0's runner sees a worker's exit
    try:
        parallel.all_reduce(torch.ones(8))
    except RuntimeError as exc:
        results.put(str(exc))


def test_a_rank_waiting_for_one_gone_stops() -> None:
    context = multiprocessing.get_context("spawn")
    left, results = context.Queue(), context.Queue()
    port = free_port()
    ranks = [context.Process(target=lone_rank_main, args=(rank, port, left, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    ranks[1].join(timeout=120)
    assert results.get(timeout=60) == "A tensor-parallel rank exited during an all-reduce."
    ranks[0].join(timeout=60)
