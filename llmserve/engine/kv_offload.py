"""A second tier for the prefix cache (vLLM's KV offloading, LMCache's local tiers; the seed's "HBM ->
DRAM -> NVMe"): the KV of full blocks evicted from the pool is kept in host memory, or in files of a
directory, and a later request whose prompt starts with those blocks gets them back instead of computing
them again.

The block manager decides (`BlockManager.tier`): a named block it evicts and the tier lacks is to be
saved; a prompt block the pool lacks but the tier holds is given a fresh block, named at once, to be
loaded. The core moves the bytes between the two before the step runs (`EngineCore._move_offloaded`):
it reads what is to be loaded, saves what was evicted (the pool still holds it: the step has not run),
then writes the loaded blocks. A block is stored whole, every layer's keys and values, as one blob.

On disk a blob is a file named by the block's content hash, under a directory for the model and the KV
layout (its checkpoint's files, their sizes and times: other weights at the same path never match), so
the cache outlives the process: the pool's named blocks are saved at shutdown too, and a restarted
engine finds its earlier prompts. Both tiers drop their least recently used blocks past their size.
"""

from __future__ import annotations

import hashlib
import logging
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from llmserve.engine.prefix_cache import BlockHash

logger = logging.getLogger(__name__)


class KVTier(ABC):
    """Blobs by block hash, the least recently used dropped first past `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.num_bytes = 0
        self.saved = 0  # blocks put since the start
        self.loaded = 0  # blocks got since the start

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._sizes

    def get(self, block_hash: BlockHash) -> bytes | None:
        if block_hash not in self._sizes:
            return None
        blob = self._read(block_hash)
        if blob is None:  # its file went missing: forget it
            self._drop(block_hash)
            return None
        self._sizes.move_to_end(block_hash)
        self.loaded += 1
        return blob

    def put(self, block_hash: BlockHash, blob: bytes) -> None:
        if block_hash in self._sizes or len(blob) > self.capacity_bytes:
            return
        while self.num_bytes + len(blob) > self.capacity_bytes:
            self._drop(next(iter(self._sizes)))
        self._write(block_hash, blob)
        self._sizes[block_hash] = len(blob)
        self.num_bytes += len(blob)
        self.saved += 1

    def clear(self) -> int:
        """Drop every block; returns how many there were."""
        dropped = len(self._sizes)
        while self._sizes:
            self._drop(next(iter(self._sizes)))
        return dropped

    def _drop(self, block_hash: BlockHash) -> None:
        self.num_bytes -= self._sizes.pop(block_hash)
        self._delete(block_hash)

    @abstractmethod
    def _read(self, block_hash: BlockHash) -> bytes | None: ...

    @abstractmethod
    def _write(self, block_hash: BlockHash, blob: bytes) -> None: ...

    @abstractmethod
    def _delete(self, block_hash: BlockHash) -> None: ...


class MemoryKVTier(KVTier):
    """The blobs in this process's memory."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._blobs: dict[BlockHash, bytes] = {}

    def _read(self, block_hash: BlockHash) -> bytes | None:
        return self._blobs.get(block_hash)

    def _write(self, block_hash: BlockHash, blob: bytes) -> None:
        self._blobs[block_hash] = blob

    def _delete(self, block_hash: BlockHash) -> None:
        self._blobs.pop(block_hash, None)


class DiskKVTier(KVTier):
    """The same, each blob a file in `directory` (what is there from an earlier run is found at start,
    the oldest files first to go)."""

    def __init__(self, capacity_bytes: int, directory: Path) -> None:
        super().__init__(capacity_bytes)
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        found = sorted((entry.stat().st_mtime_ns, entry) for entry in os.scandir(directory) if _is_blob(entry.name))
        for _, entry in found:
            size = entry.stat().st_size
            self._sizes[bytes.fromhex(entry.name)] = size
            self.num_bytes += size
        while self.num_bytes > capacity_bytes:
            self._drop(next(iter(self._sizes)))
        if found:
            logger.info("KV offload: %d blocks (%.1f MiB) found in %s", len(self._sizes), self.num_bytes / 2**20,
                        directory)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / block_hash.hex()

    def _read(self, block_hash: BlockHash) -> bytes | None:
        try:
            return self._path(block_hash).read_bytes()
        except OSError:
            return None

    def _write(self, block_hash: BlockHash, blob: bytes) -> None:
        partial = self._path(block_hash).with_suffix(".partial")
        partial.write_bytes(blob)
        os.replace(partial, self._path(block_hash))  # never a torn blob under a block's name

    def _delete(self, block_hash: BlockHash) -> None:
        self._path(block_hash).unlink(missing_ok=True)


def _is_blob(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def disk_namespace(model_dir: Path, layout: str) -> str:
    """A directory name for one model's KV in one layout: its checkpoint files' names, sizes and times
    are in it, so a checkpoint changed in place never reads the KV of the old one."""
    digest = hashlib.blake2b(layout.encode(), digest_size=16)
    digest.update(str(model_dir.resolve()).encode())
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def split_blocks(frames: list[memoryview], count: int) -> list[bytes]:
    """Per block, its part of every frame (`read_kv_blocks`' frames of `count` blocks) joined as one blob."""
    sizes = [memoryview(frame).nbytes // count for frame in frames]
    return [b"".join(frame[i * size : (i + 1) * size] for frame, size in zip(frames, sizes, strict=True))
            for i in range(count)]


def join_blocks(blobs: Iterable[bytes], num_frames: int) -> list[memoryview]:
    """Blobs of blocks back into `write_kv_blocks`' frames (each blob holds every frame's part alike)."""
    blobs = list(blobs)
    size = len(blobs[0]) // num_frames
    return [memoryview(b"".join(blob[j * size : (j + 1) * size] for blob in blobs)) for j in range(num_frames)]
