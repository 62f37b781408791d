"""Prefill/decode disaggregation: a prompt's KV computed by one engine (the prefill replica) and read by
another (the decode replica), which computes only what is left (vLLM's disaggregated prefill, llm-d's
P/D). The KV travels engine core to engine core over a ZeroMQ side channel of their own, never through
the API processes.

Export (the prefill side): a request sent with `do_remote_decode` keeps its prompt's full KV blocks when
it ends: a holder sequence takes a reference on them, filed under a random transfer id that the request's
last output carries with this engine's side-channel port. A thread answers pulls on that port: it reads
a copy of the held blocks (nothing writes them), and the step loop lets them go as it sends them. Blocks
nobody pulls go after `ttl` seconds. Under tensor parallelism (`reads_on_loop`) the blocks are read between two
steps instead, where rank 0 may gather every rank's share: the thread hands the read to the step loop and waits.

Import (the decode side): a request sent with `do_remote_prefill` waits outside the scheduler while a
thread pulls the blocks of its prompt that this engine's prefix cache lacks. The step loop then writes
them into free blocks and names them in the prefix cache (`BlockManager.adopt_blocks`), and queues the
request: its admission finds them cached, and it computes its last block only. A pull that fails (the
peer is gone, the transfer expired, another layout or LoRA adapter, other tokens) leaves the request to
compute its prompt itself: the answer is the same, only later.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import zmq

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.messages import KVTransferParams
from llmserve.engine.sequence import Sequence
from llmserve.engine.wakeup import Wakeup

logger = logging.getLogger(__name__)

PULL_TIMEOUT_S = 10.0  # a pull not answered by then fails (the request computes its prompt itself)
IMPORT_THREADS = 4  # pulls under way at once (each waits on the network, not on the interpreter)
_POLL_MS = 200  # how often the serving thread looks whether it should stop

ReadBlocks = Callable[[list[int]], list[memoryview]]


class KVPull(msgspec.Struct, array_like=True, gc=False):
    """Decode side to prefill side: send blocks [first_block, first_block + num_blocks) of a transfer."""

    transfer_id: str
    first_block: int
    num_blocks: int
    layout: str  # the asker's KV layout: the blocks are only sent to an engine that stores them alike
    adapter: str | None = None  # the LoRA adapter the asker generates with: the KV must have been computed with it


class KVPullReply(msgspec.Struct, array_like=True, gc=False):
    """The answer's first frame; on success the blocks follow, a key and a value frame per layer."""

    error: str | None = None
    token_ids: list[int] = []  # the tokens the sent blocks hold, for the asker to check


@dataclass(slots=True)
class PulledKV:
    """Blocks pulled from a prefill engine: `frames` hold, per layer, its key and then its value blocks."""

    first_block: int
    num_blocks: int
    token_ids: list[int]  # the tokens the prefill engine says they hold
    frames: list[memoryview]


@dataclass(slots=True)
class _Export:
    holder: Sequence
    deadline: float
    serving: bool = False  # a pull is reading its blocks: they stay held whatever the clock says


@dataclass
class KVTransferCounts:
    blocks_sent: int = 0
    blocks_received: int = 0
    pulls_failed: int = 0
    exports_expired: int = 0


@dataclass
class KVTransfer:
    """Both sides of one engine's transfers; every method but the threads' runs on the step loop."""

    read_blocks: ReadBlocks
    layout: str
    block_size: int
    host: str = "0.0.0.0"
    port: int = 0
    ttl: float = 30.0
    counts: KVTransferCounts = field(default_factory=KVTransferCounts)
    reads_on_loop: bool = False  # the serving thread has the step loop read the blocks (`serve_reads`)

    def __post_init__(self) -> None:
        self.wakeup = Wakeup()
        self._context = zmq.Context()
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}
        self._served: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._importers = ThreadPoolExecutor(IMPORT_THREADS, thread_name_prefix="llmserve-kv-import")
        self._stop = threading.Event()
        self._reads: queue.SimpleQueue[tuple[list[int], Future[list[memoryview]]]] = queue.SimpleQueue()
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        if self.port:
            socket.bind(f"tcp://{self.host}:{self.port}")
        else:
            self.port = socket.bind_to_random_port(f"tcp://{self.host}")
        self._server = threading.Thread(target=self._serve, args=(socket,), name="llmserve-kv-export", daemon=True)
        self._server.start()
        logger.info("KV transfer: serving held blocks on %s:%d (kept %.0f s unpulled)", self.host, self.port, self.ttl)

    # ---- export ---------------------------------------------------------------------------------
    def hold(self, seq: Sequence, block_manager: BlockManager) -> KVTransferParams:
        """Keep the full blocks of `seq`'s computed prompt (it is ending) for a decode engine to pull."""
        num_blocks = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        tokens = seq.token_ids[: num_blocks * self.block_size]
        holder = Sequence(seq.request, seq.index, tokens, len(tokens), seq.seed)
        block_manager.share(seq, holder, num_blocks)
        holder.num_computed_tokens = len(tokens)
        transfer_id = secrets.token_hex(16)
        with self._lock:
            self._exports[transfer_id] = _Export(holder, time.monotonic() + self.ttl)
        return KVTransferParams(transfer_id=transfer_id, remote_port=self.port, num_tokens=len(tokens))

    def release_done(self, block_manager: BlockManager, now: float | None = None) -> bool:
        """Let go of the blocks that were pulled, and of those nobody pulled in time; True when some were."""
        released_any = False
        while True:
            try:
                transfer_id = self._served.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                export = self._exports.pop(transfer_id, None)
            if export is not None:
                block_manager.release(export.holder)
                released_any = True
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [tid for tid, e in self._exports.items() if not e.serving and e.deadline <= now]
            released = [self._exports.pop(tid) for tid in expired]
        for export in released:
            block_manager.release(export.holder)
        self.counts.exports_expired += len(released)
        return released_any or bool(released)

    def serve_reads(self) -> None:
        """Read the blocks the serving thread asked the step loop for (`reads_on_loop`)."""
        while True:
            try:
                block_ids, future = self._reads.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.read_blocks(block_ids))
                except Exception as exc:  # the pull fails; the engine goes on
                    future.set_exception(exc)

    def _read(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes: read here, or between two steps by the step loop (`reads_on_loop`)."""
        if not self.reads_on_loop:
            return self.read_blocks(block_ids)
        future: Future[list[memoryview]] = Future()
        self._reads.put((block_ids, future))
        self.wakeup.notify()
        try:
            return future.result(timeout=PULL_TIMEOUT_S)
        except TimeoutError:
            future.cancel()  # not read yet: the loop skips it
            raise

    def holders(self) -> list[Sequence]:
        with self._lock:
            return [export.holder for export in self._exports.values()]

    def next_deadline(self) -> float | None:
        """When the first held export expires (time.monotonic); None with none held."""
        with self._lock:
            return min((e.deadline for e in self._exports.values()), default=None)

    def _claim(self, transfer_id: str) -> Sequence | None:
        with self._lock:
            export = self._exports.get(transfer_id)
            if export is None or export.serving:
                return None
            export.serving = True
            return export.holder

    def _unclaim(self, transfer_id: str) -> None:
        """A pull that sent nothing: the transfer waits for another (or its deadline)."""
        with self._lock:
            export = self._exports.get(transfer_id)
            if export is not None:
                export.serving = False

    def _serve(self, socket: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(KVPull)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                identity, *frames = socket.recv_multipart(copy=False)
                try:
                    pull = decoder.decode(frames[-1].buffer)
                except (msgspec.DecodeError, IndexError):
                    socket.send_multipart([identity, encoder.encode(KVPullReply("a malformed pull"))])
                    continue
                try:
                    reply, blocks = self._answer(pull)
                except Exception as exc:  # whatever went wrong with this pull, the next ones are served
                    logger.exception("KV transfer: a pull of %r failed", pull.transfer_id)
                    self._unclaim(pull.transfer_id)
                    reply, blocks = KVPullReply(f"the blocks could not be read: {exc}"), []
                if reply.error is None:  # the blocks are copied out: the step loop may let them go now
                    self._served.put(pull.transfer_id)
                    self.counts.blocks_sent += pull.num_blocks
                    self.wakeup.notify()
                socket.send_multipart([identity, encoder.encode(reply), *blocks], copy=False)
        finally:
            socket.close(linger=0)

    def _answer(self, pull: KVPull) -> tuple[KVPullReply, list[memoryview]]:
        if pull.layout != self.layout:
            return KVPullReply(f"KV layout {pull.layout!r} differs from this engine's {self.layout!r}"), []
        holder = self._claim(pull.transfer_id)
        if holder is None:
            return KVPullReply(f"no transfer {pull.transfer_id!r} is held here (expired, or pulled already)"), []
        adapter = holder.request.lora.lora_name if holder.request.lora is not None else None
        if pull.adapter != adapter:
            self._unclaim(pull.transfer_id)
            return KVPullReply(f"the KV was computed with LoRA adapter {adapter!r}, not {pull.adapter!r}"), []
        first, count = pull.first_block, pull.num_blocks
        if first < 0 or count < 1 or first + count > len(holder.block_table):
            self._unclaim(pull.transfer_id)
            return KVPullReply(f"blocks {first}..{first + count} are outside the {len(holder.block_table)} held"), []
        tokens = holder.token_ids[first * self.block_size : (first + count) * self.block_size]
        return KVPullReply(None, tokens), self._read(holder.block_table[first : first + count])

    # ---- import ---------------------------------------------------------------------------------
    def pull(self, host: str, port: int, transfer_id: str, first_block: int, num_blocks: int,
             adapter: str | None = None) -> Future[PulledKV]:
        """Pull a transfer's blocks (computed with LoRA `adapter`) on an import thread; the future holds them,
        or the reason it failed."""
        future = self._importers.submit(self._pull_one, f"tcp://{host}:{port}",
                                        KVPull(transfer_id, first_block, num_blocks, self.layout, adapter))
        future.add_done_callback(lambda _: self.wakeup.notify())
        return future

    def _pull_one(self, address: str, pull: KVPull) -> PulledKV:
        """One pull on a socket of its own: a peer that is gone holds up no other pull, and no late answer
        is read as another pull's."""
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            socket.send(msgspec.msgpack.encode(pull))
            if not socket.poll(int(PULL_TIMEOUT_S * 1000)):
                raise TimeoutError(f"{address} did not answer a KV pull within {PULL_TIMEOUT_S:.0f} s")
            head, *blocks = socket.recv_multipart(copy=False)
        finally:
            socket.close(linger=0)
        reply = msgspec.msgpack.decode(head.buffer, type=KVPullReply)
        if reply.error is not None:
            raise LookupError(reply.error)
        return PulledKV(pull.first_block, pull.num_blocks, reply.token_ids, [frame.buffer for frame in blocks])

    def close(self, block_manager: BlockManager | None = None) -> None:
        self._stop.set()
        self._importers.shutdown(wait=True, cancel_futures=True)
        self._server.join(timeout=5)
        if block_manager is not None:
            with self._lock:
                exports, self._exports = list(self._exports.values()), {}
            for export in exports:
                block_manager.release(export.holder)
        self._context.term()
        self.wakeup.close()
