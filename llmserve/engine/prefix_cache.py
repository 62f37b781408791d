"""Content addressing for full KV blocks (automatic prefix caching).

A full block is named by a chained hash: hash(parent block's hash, the block's token ids, and the names of the
images whose placeholder tokens it holds). The chain's root is a hash of whatever else changes the KV for the
same tokens (the model, later a LoRA adapter) and of the request's `cache_salt`, so requests with different
salts never share a block. The hash is a 128-bit BLAKE2b digest; on top of that every cached block keeps
its parent hash and its token tuple, and a lookup only counts as a hit when both are equal, so a colliding
hash can only cost a miss.

This module only names blocks and maps names to block ids; the block manager owns the blocks, their
reference counts and the eviction order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes

_DIGEST_SIZE = 16


def hash_root(*identity: object) -> BlockHash:
    """The chain's root: the cache namespace (model identity, cache salt, ...)."""
    return hashlib.blake2b(repr(identity).encode(), digest_size=_DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, tokens: Sequence[int], images: bytes = b"") -> BlockHash:
    """The name of a full block holding `tokens` after the prefix named `parent`; `images`: the names of the
    images whose placeholder tokens it holds (the same tokens, other images: another block)."""
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(array("q", tokens).tobytes())
    digest.update(images)
    return digest.digest()


@dataclass(slots=True, frozen=True)
class CachedBlock:
    """What a cached block holds, kept to check a hash match is a real match."""

    block_hash: BlockHash
    parent_hash: BlockHash
    tokens: tuple[int, ...]


class PrefixCache:
    """hash -> block id for full blocks whose KV is computed, and the reverse."""

    def __init__(self) -> None:
        self.by_hash: dict[BlockHash, int] = {}
        self.by_block: dict[int, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self.by_block)

    def find(self, block_hash: BlockHash, parent: BlockHash, tokens: Sequence[int]) -> int | None:
        """The block named `block_hash` if it really holds `tokens` after `parent`, else None."""
        block = self.by_hash.get(block_hash)
        if block is None:
            return None
        entry = self.by_block[block]
        if entry.parent_hash != parent or entry.tokens != tuple(tokens):
            return None  # a hash collision: only a miss
        return block

    def register(self, block: int, block_hash: BlockHash, parent: BlockHash, tokens: Sequence[int]) -> bool:
        """Name `block` (its KV now computed). False when the name is taken (by an equal block
        computed at the same time, or by a collision): the block then simply stays unnamed."""
        if block in self.by_block or block_hash in self.by_hash:
            return False
        self.by_hash[block_hash] = block
        self.by_block[block] = CachedBlock(block_hash, parent, tuple(tokens))
        return True

    def forget(self, block: int) -> None:
        """Drop `block`'s name (it is about to be overwritten with other tokens)."""
        entry = self.by_block.pop(block, None)
        if entry is not None:
            del self.by_hash[entry.block_hash]

    def is_cached(self, block: int) -> bool:
        return block in self.by_block
