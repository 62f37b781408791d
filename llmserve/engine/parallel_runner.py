"""Tensor parallelism's processes (model/parallel.py has the split): the engine core's runner is rank 0, and it
starts ranks 1..N-1 as worker processes, each a ModelRunner over its own shard. Every step, rank 0 sends the step
batch to the workers (pickled down a pipe to each: tens of microseconds, where gloo's object broadcast took half
a millisecond) and all ranks run it together, meeting in each layer's all-reduce; every rank samples the same
tokens, so rank 0 alone reports them and nothing else comes back. The KV tier's saves and loads (between steps)
read every rank's share of the blocks into rank 0 and send each rank its share back. A LoRA adapter rank 0 reads, each worker reads
too (its own share of it), in the same state, so every rank puts it in the same slot.

A worker is started with `python -m llmserve.engine.parallel_runner`, its arguments pickled on its stdin, which stays
open: the worker exits when it closes (its engine core ended, however it ended). A worker that dies fails rank 0's
next collective, so the engine core fails and its front end restarts it, workers and all.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from llmserve.config import EngineConfig
from llmserve.errors import InvalidRequestError
from llmserve.model import parallel
from llmserve.model.config import ModelConfig
from llmserve.model.lora import LoRASlots
from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolerConfig
from llmserve.model.runner import ModelRunner, StepBatch, StepHandle, resolve_device

logger = logging.getLogger(__name__)

WORKER_EXIT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class _WorkerArgs:
    setup: parallel.ParallelSetup
    config: EngineConfig
    model_config: ModelConfig
    model_dir: Path
    max_model_len: int
    pooler: PoolerConfig | None
    log_level: int
    control_fd: int  # the read end of the pipe rank 0 sends the worker its messages down


class ParallelRunner:
    """Rank 0's ModelRunner, with the workers that hold the other shards: `execute` runs a step on every rank;
    everything else is rank 0's runner's."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, model_dir: Path, max_model_len: int,
        pooler: PoolerConfig | None, shared_bytes_per_block: int = 0,
    ) -> None:
        """`shared_bytes_per_block`: a draft model's KV per block, on rank 0 (see ModelRunner)."""
        ranks = config.tensor_parallel_size
        meeting = f"tcp://127.0.0.1:{_free_port()}"
        self._workers: list[subprocess.Popen] = []
        self._controls: list[BinaryIO] = []  # each worker's message pipe
        try:
            for rank in range(1, ranks):
                read_end, write_end = os.pipe()
                args = _WorkerArgs(parallel.ParallelSetup(rank, ranks, meeting), config, model_config, Path(model_dir),
                                   max_model_len, pooler, logging.getLogger().getEffectiveLevel(), read_end)
                try:
                    self._workers.append(_start_worker(args))
                finally:
                    os.close(read_end)
                self._controls.append(open(write_end, "wb"))  # closed by _stop_workers
            parallel.init(parallel.ParallelSetup(0, ranks, meeting), resolve_device(config.device),
                          peers_alive=lambda: all(worker.poll() is None for worker in self._workers))
            self.runner = ModelRunner(config, model_config, model_dir, max_model_len, pooler,
                                      shared_bytes_per_block=shared_bytes_per_block)
            self.lora = _ParallelLoRA(self.runner.lora, self._send) if self.runner.lora is not None else None
        except BaseException:
            self._stop_workers()
            raise
        logger.info("tensor parallel over %d ranks (worker pids %s)", ranks, [w.pid for w in self._workers])

    def __getattr__(self, name: str) -> Any:
        if name == "runner":  # not built (yet): no recursion through this method
            raise AttributeError(name)
        return getattr(self.runner, name)

    def execute(self, batch: StepBatch) -> StepHandle:
        self._send(batch)
        return self.runner.execute(batch)

    def _send(self, message: Any) -> None:
        """The same message to every worker, in order with the others (each worker's loop reads its pipe)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        framed = len(data).to_bytes(8, "little") + data
        for control in self._controls:
            control.write(framed)
            control.flush()

    @property
    def kv_layout(self) -> str:
        return f"{self.runner.kv_layout} over {parallel.size()} ranks"

    @property
    def num_kv_frames(self) -> int:
        """Each rank's frames, rank after rank: its share of every layer's keys and values."""
        return self.runner.num_kv_frames * parallel.size()

    def read_kv_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """Every rank's share of these blocks (the KV tier's saves), between two steps."""
        self._send(_ReadKV(block_ids))
        own = self.runner.read_kv_blocks(block_ids)
        gathered = parallel.gather(None)
        assert gathered is not None
        return own + [memoryview(frame) for frames in gathered[1:] for frame in frames]

    def write_kv_blocks(self, block_ids: list[int], frames: Sequence[memoryview]) -> None:
        """Each rank's share of these blocks put in place (the KV tier's loads), between two steps; the frames
        are checked before any rank writes."""
        per_rank = self.runner.num_kv_frames
        if len(frames) != self.num_kv_frames:
            raise ValueError(f"{len(frames)} KV frames for {self.num_kv_frames} (every rank's layers)")
        self.runner.check_kv_frames(block_ids, frames)
        self._send(_WriteKV(block_ids))
        parallel.scatter([None] + [[bytes(frame) for frame in frames[rank * per_rank : (rank + 1) * per_rank]]
                                   for rank in range(1, parallel.size())])
        self.runner.write_kv_blocks(block_ids, frames[:per_rank])

    def read_weights(self, model_dir: Path) -> list:
        """Rank 0's weights read and checked (on a thread, as steps go on); the others read theirs at the swap."""
        return _CheckpointWeights(self.runner.read_weights(model_dir), Path(model_dir))

    def swap_weights(self, weights: _CheckpointWeights) -> None:
        """Between two steps: every rank puts its share of the checkpoint in place; the other ranks read theirs
        now, so the next step waits for that."""
        self._send(_SwapWeights(weights.model_dir))
        self.runner.swap_weights(weights)

    def close(self) -> None:
        """Stop the workers (each ends its loop) and leave the group."""
        try:
            self._send(None)
        except OSError:
            pass  # a worker gone already: stopping them is all that is left
        finally:
            self._stop_workers()
            parallel.close()

    def _stop_workers(self) -> None:
        for control in self._controls:
            try:
                control.close()
            except OSError:
                pass  # its worker is gone, with what was left unsent
        self._controls = []
        for worker in self._workers:
            if worker.stdin is not None:
                worker.stdin.close()  # a worker not yet in its loop exits on this
        for worker in self._workers:
            try:
                worker.wait(WORKER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self._workers = []


class _ParallelLoRA:
    """Rank 0's LoRA slots, whose adapters every rank reads: the same adapter read in the same state on each (the
    ids of live requests, which may not be dropped from the host cache, sent along), so their slots agree."""

    def __init__(self, slots: LoRASlots, send: Callable[[Any], None]) -> None:
        self.slots = slots
        self._send = send

    def __getattr__(self, name: str) -> Any:
        return getattr(self.slots, name)

    def add(self, request: LoRARequest, in_use: Callable[[], Collection[int]] = frozenset) -> None:
        live = frozenset(in_use())
        self._send(_ReadAdapter(request, live))
        self.slots.add(request, lambda: live)


@dataclass(frozen=True)
class _ReadAdapter:
    request: LoRARequest
    in_use: frozenset[int]


@dataclass(frozen=True)
class _SwapWeights:
    model_dir: Path


@dataclass(frozen=True)
class _ReadKV:
    block_ids: list[int]


@dataclass(frozen=True)
class _WriteKV:
    block_ids: list[int]


class _CheckpointWeights(list):
    """Rank 0's read weights, with the checkpoint they came from (for the other ranks to read)."""

    def __init__(self, weights: list, model_dir: Path) -> None:
        super().__init__(weights)
        self.model_dir = model_dir


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_worker(args: _WorkerArgs) -> subprocess.Popen:
    worker = subprocess.Popen([sys.executable, "-m", "llmserve.engine.parallel_runner"], stdin=subprocess.PIPE,
                              pass_fds=(args.control_fd,))
    assert worker.stdin is not None
    worker.stdin.write(pickle.dumps(args))
    worker.stdin.flush()  # and kept open: its end is the worker's signal to exit
    return worker


def _run_worker() -> None:
    args: _WorkerArgs = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.setup.rank}]: %(message)s")
    threading.Thread(target=_exit_when_stdin_closes, name="llmserve-parent-watch", daemon=True).start()
    parallel.init(args.setup, resolve_device(args.config.device))
    runner = ModelRunner(args.config, args.model_config, args.model_dir, args.max_model_len, args.pooler)
    with open(args.control_fd, "rb") as control:
        _serve(runner, control)
    parallel.close()


def _receive(control: BinaryIO) -> Any:
    """Rank 0's next message; None when it says to stop, or its end of the pipe closed."""
    header = control.read(8)
    if len(header) < 8:
        return None
    return pickle.loads(control.read(int.from_bytes(header, "little")))


def _serve(runner: ModelRunner, control: BinaryIO) -> None:
    while (message := _receive(control)) is not None:
        if isinstance(message, _ReadAdapter):
            _read_adapter(runner, message)
        elif isinstance(message, _SwapWeights):
            runner.swap_weights(runner.read_weights(message.model_dir))
        elif isinstance(message, _ReadKV):
            parallel.gather([bytes(frame) for frame in runner.read_kv_blocks(message.block_ids)])
        elif isinstance(message, _WriteKV):
            runner.write_kv_blocks(message.block_ids, [memoryview(frame) for frame in parallel.scatter()])
        else:
            runner.execute(message)


def _read_adapter(runner: ModelRunner, message: _ReadAdapter) -> None:
    assert runner.lora is not None
    try:
        runner.lora.add(message.request, lambda: message.in_use)
    except InvalidRequestError:
        pass  # rank 0 failed to read it too, and fails its request


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


if __name__ == "__main__":
    # By its import name, not as __main__: the messages rank 0 pickles name this module's classes.
    from llmserve.engine import parallel_runner

    parallel_runner._run_worker()
