"""An all-reduce for tensor-parallel ranks on one CPU machine, through shared memory: gloo's goes over TCP and
takes about 1 ms a call on a 2-core machine (a Llama layer makes two), where this one takes microseconds.

The segment (a file in /dev/shm, mapped by every rank) holds a counter per rank and two buffers, each with a slot
per rank. Call n: a rank copies its tensor into its slot of buffer n % 2 and sets its counter to n, waits until
every counter reaches n, then adds the slots in rank order (so every rank gets the same bits). A rank that comes to
call n + 2, which reuses the buffer, has seen every counter at n + 1: every rank has finished reading call n.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # larger tensors (long prefill chunks) go through the collective backend, where latency is small
_LINE = 64  # each counter on its own cache line
_SPINS_BEFORE_YIELD = 64
PEER_CHECK_S = 0.05  # how often a waiting rank asks whether the others still live


class SharedMemoryAllReduce:
    def __init__(self, rank: int, world_size: int, path: Path, peers_alive: Callable[[], bool]) -> None:
        """`peers_alive`: False once another rank has exited (a wait for it would never end)."""
        self.rank, self.world_size = rank, world_size
        self._peers_alive = peers_alive
        self._calls = 0
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), _segment_bytes(world_size))
        counters = np.frombuffer(self._map, dtype=np.int64, count=world_size * _LINE // 8)
        self._counters = counters[:: _LINE // 8]  # a strided view: one int64 per cache line
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=world_size * _LINE)

    @staticmethod
    def create(world_size: int) -> Path:
        """A zeroed segment for `world_size` ranks (rank 0 makes it; each rank then opens it by path)."""
        fd, name = tempfile.mkstemp(prefix="llmserve-allreduce-", dir=SHM_DIR)
        os.ftruncate(fd, _segment_bytes(world_size))
        os.close(fd)
        return Path(name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place."""
        self._calls += 1
        buffer = self._calls % 2
        nbytes = x.numel() * x.element_size()
        self._slot(buffer, self.rank, x, nbytes).copy_(x.view(-1))
        self._counters[self.rank] = self._calls
        self._wait_for_all(self._calls)
        total = self._slot(buffer, 0, x, nbytes).clone()
        for rank in range(1, self.world_size):
            total += self._slot(buffer, rank, x, nbytes)
        x.view(-1).copy_(total)
        return x

    def _slot(self, buffer: int, rank: int, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        start = (buffer * self.world_size + rank) * SLOT_BYTES
        return self._data[start : start + nbytes].view(x.dtype)

    def _wait_for_all(self, call: int) -> None:
        spins = 0
        next_check = time.monotonic() + PEER_CHECK_S
        while self._counters.min() < call:
            spins += 1
            if spins % _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # the other ranks may need this core to get here
            if time.monotonic() > next_check:
                if not self._peers_alive():
                    raise RuntimeError("A tensor-parallel rank exited during an all-reduce.")
                next_check = time.monotonic() + PEER_CHECK_S

    def close(self) -> None:
        self._counters = self._data = None  # type: ignore[assignment]
        self._map.close()


def available() -> bool:
    """Shared memory to map, on x86, whose stores reach other cores in program order (a rank's counter is never
    seen before its data); elsewhere the collective backend's all-reduce serves."""
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _segment_bytes(world_size: int) -> int:
    return world_size * _LINE + 2 * world_size * SLOT_BYTES
