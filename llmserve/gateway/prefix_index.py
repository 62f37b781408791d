"""An approximate, bounded record of which prompt prefixes each replica has in its KV cache.

The gateway never sees a replica's cache; it remembers what it sent where. A prompt (token ids, or
text when the gateway does not tokenize) is cut into fixed-size blocks, and each full block is named
by a hash chained over every block before it, as vLLM's prefix cache names KV blocks and llm-d's
prefix scorer indexes them. A chained hash stands for the whole prefix up to and including its block,
so the set of hashes a replica holds is a prefix tree whose nodes are addressed by their path: looking
a prompt up is one pass over its blocks (O(prompt length)), with no tree walk and no string compares.
A partial last block is left out, as a replica caches only full KV blocks.

Approximate on purpose: a replica may have evicted what we remember, or a hash may collide; either
way the cost is one request routed less well, never a wrong answer.

Memory is bounded per replica, since each replica's own cache is: at most `max_blocks_per_replica`
hashes each, the least recently used evicted first. A prompt's blocks are touched from its last to
its first, so a shared prefix (a system prompt) is always more recent than the tails that hang off
it and the tails go first, as leaves go first from a radix tree (SGLang's router evicts the same way)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PromptKey = str | Sequence[int]


def block_hashes(prompt: PromptKey, *, tokens_per_block: int, chars_per_block: int,
                 cache_key: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks: token ids in blocks of `tokens_per_block`, text
    in blocks of `chars_per_block` characters. A `cache_key` (the request's `prompt_cache_key`) is a
    block of its own before them. Python's hash: stable within a process, which is all an in-memory
    index needs."""
    text = isinstance(prompt, str)
    size = chars_per_block if text else tokens_per_block
    hashes: list[int] = []
    parent = 0
    if cache_key is not None:
        parent = hash(("prompt_cache_key", cache_key))
        hashes.append(parent)
    for start in range(0, len(prompt) - size + 1, size):
        block = prompt[start:start + size]
        parent = hash((parent, block if text else tuple(block)))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """For each replica (by name), the block hashes recently sent to it, in LRU order."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        if max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be at least 1, got {max_blocks_per_replica}.")
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # replica -> its hashes, oldest first
        self._holders: dict[int, set[str]] = {}  # hash -> replicas holding it

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """How many leading blocks of the prompt each replica holds (replicas holding none are absent)."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        alive = set(self._holders.get(hashes[0], ()))
        for depth, block in enumerate(hashes[1:], start=1):
            if not alive:
                break
            holders = self._holders.get(block, set())
            for name in alive - holders:
                matched[name] = depth
            alive &= holders
        for name in alive:
            matched[name] = len(hashes)
        return matched

    def insert(self, replica: str, hashes: Sequence[int]) -> None:
        """Record the prompt as cached on the replica (or refresh it), then evict past the bound."""
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for block in reversed(hashes):  # the first block ends up the most recent
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
                self._holders.setdefault(block, set()).add(replica)
        while len(blocks) > self.max_blocks_per_replica:
            oldest, _ = blocks.popitem(last=False)
            self._release(oldest, replica)

    def drop(self, replica: str) -> None:
        """Forget everything about the replica (ejected, restarted, or gone from the pool)."""
        for block in self._blocks.pop(replica, ()):
            self._release(block, replica)

    def size(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    @property
    def total_size(self) -> int:
        return sum(len(blocks) for blocks in self._blocks.values())

    @property
    def distinct_blocks(self) -> int:
        """Blocks recorded on at least one replica (a block on two replicas counts once)."""
        return len(self._holders)

    def _release(self, block: int, replica: str) -> None:
        holders = self._holders[block]
        holders.discard(replica)
        if not holders:
            del self._holders[block]
