"""The paged KV cache's bookkeeping: a fixed pool of blocks, per-sequence block tables, ref counts.

The tensors live in the model runner; this class only decides which block ids hold which tokens.
A block may be shared (forked sequences share their prompt's full blocks; with prefix caching any
sequences whose tokens start the same share their common full blocks), so blocks are
reference-counted.

With prefix caching a full block whose KV is computed gets a content name (see `prefix_cache`), and
when its last owner lets go it is not wiped: it waits, still named, on an LRU list of evictable
blocks. A new sequence starting with the same tokens takes it back instead of recomputing it. Blocks
are allocated from the never-named free blocks first, then from the evictable ones, least recently
used first; everything is O(1) per block.

With a second tier (`tier`, kv_offload.py) a named block evicted from the pool is first saved there,
when the tier lacks it, and a prompt's blocks past the pool's cached prefix that the tier holds are
given fresh blocks, named at once, their KV read from the tier then: `take_moves` hands the engine
core the blocks to save and the KV to load before the step runs.

A sequence's last, partly filled block is kept too when it lets go (a "tail": the computed tokens past
its last full block, named by the hash of the prefix before them). It cannot be shared, since its free
slots would be written, so it is handed whole to the first new sequence that continues those tokens
(the next turn of a conversation): reuse to the token, not just to the block.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

from llmserve.engine import prefix_cache
from llmserve.engine.kv_offload import KVTier
from llmserve.engine.prefix_cache import BlockHash, PrefixCache
from llmserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 tier: KVTier | None = None) -> None:
        if num_blocks < 0:  # none: an encoder's engine, which keeps no KV
            raise ValueError("The KV cache cannot have a negative number of blocks.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and unnamed
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, named; LRU first
        self.cache: PrefixCache | None = PrefixCache() if enable_prefix_caching else None
        self._tails: dict[BlockHash, tuple[int, tuple[int, ...]]] = {}  # prefix name -> (block, its tokens)
        # Tail block -> the prefix name it is filed under, least recently kept first. Tails serve one
        # successor at most, so they are evicted before named full blocks.
        self._tail_prefix: OrderedDict[int, BlockHash] = OrderedDict()
        self.prefix_queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of which found cached
        self.tier = tier  # the second tier, with prefix caching
        self._to_save: dict[int, BlockHash] = {}  # evicted since the last step: block -> the name it held
        self._to_load: dict[int, bytes] = {}  # given a name the tier holds: block -> the KV read from the tier

    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: the unused ones and the cached ones nobody holds."""
        return len(self._free) + len(self._tail_prefix) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache) if self.cache is not None else 0

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must take so its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to cover `num_tokens` tokens. The caller checked `can_grow`."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {self.num_free_blocks}")
        for _ in range(needed):
            seq.block_table.append(self._allocate())

    def allocate_one(self, seq: Sequence) -> int | None:
        """Append one fresh block to `seq`'s table (a copy-on-write target); None if the pool is dry."""
        if not self.num_free_blocks:
            return None
        block = self._allocate()
        seq.block_table.append(block)
        return block

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._tail_prefix:
            block = next(iter(self._tail_prefix))  # the oldest tail
            self._drop_tail(block)
        else:
            block, _ = self._evictable.popitem(last=False)  # the least recently used cached block
            assert self.cache is not None
            self._evict(block)
        self.ref_counts[block] = 1
        return block

    def _evict(self, block: int) -> None:
        """Forget a cached block's name, its KV first marked to be saved in the tier if the tier lacks it."""
        assert self.cache is not None
        name = self.cache.by_block[block].block_hash
        if self._to_load.pop(block, None) is None and self.tier is not None and name not in self.tier:
            self._to_save.setdefault(block, name)  # what it held before this step: saved before any load
        self.cache.forget(block)

    def take_moves(self) -> tuple[dict[int, BlockHash], dict[int, bytes]]:
        """Since the last call: the blocks to save in the tier under their old names (their KV as it is
        before the next step), and the KV read from the tier for blocks to load."""
        moves = (self._to_save, self._to_load)
        self._to_save, self._to_load = {}, {}
        return moves

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (finish, abort, preemption)."""
        self._keep_tail(seq)
        # Last block first: of a freed sequence's blocks, its tail is the first to be evicted.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._put_back(block)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _put_back(self, block: int) -> None:
        if block in self._tail_prefix:
            return  # filed as a tail already
        if self.cache is not None and self.cache.is_cached(block):
            self._evictable[block] = None
        else:
            self._free.append(block)

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give `child` the first `num_blocks` blocks of `parent` (full blocks only, never written again)."""
        shared = parent.block_table[:num_blocks]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.block_hashes = parent.block_hashes[:num_blocks]
        child.num_registered_blocks = min(num_blocks, parent.num_registered_blocks)

    # ---- prefix caching ---------------------------------------------------------------------------
    def _tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def _block_hash(self, seq: Sequence, index: int) -> BlockHash:
        """The content name of `seq`'s full block `index`; each is computed once per sequence, from
        the previous one (tokens are only ever appended, so the names stay valid)."""
        hashes = seq.block_hashes
        while len(hashes) <= index:
            parent = hashes[-1] if hashes else seq.cache_root
            hashes.append(prefix_cache.hash_block(parent, self._tokens(seq, len(hashes)), self._images(seq, len(hashes))))
        return hashes[index]

    def _images(self, seq: Sequence, index: int) -> bytes:
        """The names of the images with placeholder tokens in `seq`'s block `index`."""
        images = seq.request.images
        if not images:
            return b""
        begin, end = index * self.block_size, (index + 1) * self.block_size
        return b"".join(image.digest for image in images if image.offset < end and image.offset + image.length > begin)

    def _parent_hash(self, seq: Sequence, index: int) -> BlockHash:
        return self._block_hash(seq, index - 1) if index else seq.cache_root

    def _find(self, seq: Sequence, index: int) -> int | None:
        assert self.cache is not None
        return self.cache.find(self._block_hash(seq, index), self._parent_hash(seq, index), self._tokens(seq, index))

    def _max_reusable_blocks(self, seq: Sequence) -> int:
        return (seq.num_tokens - 1) // self.block_size  # the last token is always computed: logits

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of a block-less sequence are cached now, in the pool or the tier (nothing
        is taken)."""
        if self.cache is None or seq.block_table:
            return 0
        for k in range(self._max_reusable_blocks(seq)):
            if self._find(seq, k) is None and (self.tier is None or self._block_hash(seq, k) not in self.tier):
                return k
        return self._max_reusable_blocks(seq)

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix; returns how
        many of its tokens they hold (the scheduler marks them computed). Undo with `release`."""
        if self.cache is None or seq.block_table:
            return 0
        self._take_prefix(seq, self._max_reusable_blocks(seq))
        seq.num_registered_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size + self._take_tail(seq)

    def _take_prefix(self, seq: Sequence, limit: int) -> None:
        """Give `seq` the cached blocks of its first `limit` blocks up to the first missing one: the pool's,
        then the tier's."""
        assert self.cache is not None
        for k in range(limit):
            block = self._find(seq, k)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        if self.tier is not None:
            self._take_from_tier(seq, limit)

    def _take_from_tier(self, seq: Sequence, limit: int) -> None:
        """Past the pool's cached prefix, the blocks the tier holds: each a fresh block, named now, its KV
        loaded before the step (while nothing else can take it: `seq` holds it)."""
        assert self.cache is not None and self.tier is not None
        for k in range(len(seq.block_table), limit):
            name = self._block_hash(seq, k)
            if name not in self.tier or not self.num_free_blocks:
                return
            block = self._allocate()
            blob = self.tier.get(name)
            if blob is None or not self.cache.register(block, name, self._parent_hash(seq, k), self._tokens(seq, k)):
                self.ref_counts[block] = 0
                self._free.append(block)
                return
            self._to_load[block] = blob
            seq.block_table.append(block)

    def adopt_blocks(self, seq: Sequence, first: int, count: int) -> list[int] | None:
        """For KV computed elsewhere (disaggregation): give block-less `seq` its cached full blocks before
        `first` (from the pool, or loaded from the tier) and fresh blocks for its next `count`, which the
        caller writes, then names (`register_computed`) and lets go (`release`), so they wait in the cache as
        if computed here.
        Returns the fresh blocks; None, with nothing taken, when a block before `first` is no longer
        cached or the pool cannot spare `count` blocks."""
        assert self.cache is not None and not seq.block_table
        self._take_prefix(seq, first)
        if len(seq.block_table) < first:
            self.release(seq)
            return None
        seq.num_registered_blocks = first
        if count > self.num_free_blocks:
            self.release(seq)
            return None
        fresh = [self._allocate() for _ in range(count)]
        seq.block_table.extend(fresh)
        return fresh

    def _keep_tail(self, seq: Sequence) -> None:
        """File `seq`'s partly filled, computed last block as a tail, if nobody else holds it (never an
        embedding request's: its blocks are not named, and nothing is kept of them)."""
        if self.cache is None or seq.request.pooling is not None:
            return
        computed = _known_computed(seq)
        full = computed // self.block_size
        filled = computed - full * self.block_size
        if not filled or full >= len(seq.block_table) or self.ref_counts[seq.block_table[full]] != 1:
            return
        block = seq.block_table[full]
        if self.cache.is_cached(block) or block in self._tail_prefix:
            return
        prefix = self._parent_hash(seq, full)
        replaced = self._tails.get(prefix)
        if replaced is not None:  # one tail per prefix: the newest wins, the older block is plain free
            self._drop_tail(replaced[0])
            self._free.append(replaced[0])
        tokens = tuple(seq.token_ids[full * self.block_size : computed])
        self._tails[prefix] = (block, tokens)
        self._tail_prefix[block] = prefix

    def _drop_tail(self, block: int) -> bool:
        prefix = self._tail_prefix.pop(block, None)
        if prefix is None:
            return False
        del self._tails[prefix]
        return True

    def _take_tail(self, seq: Sequence) -> int:
        """After `seq` took its cached full blocks, take the tail that continues them: the block
        becomes `seq`'s own (its free slots are written next). Returns the tokens it holds for `seq`."""
        index = len(seq.block_table)
        entry = self._tails.get(self._parent_hash(seq, index))
        if entry is None:
            return 0
        block, tokens = entry
        start = index * self.block_size
        limit = min(len(tokens), seq.num_tokens - 1 - start)  # the last token is always computed
        matched = 0
        while matched < limit and seq.token_ids[start + matched] == tokens[matched]:
            matched += 1
        if not matched:
            return 0
        self._drop_tail(block)
        self.ref_counts[block] = 1
        seq.block_table.append(block)
        return matched

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their KV came from weights since replaced): the unheld ones are
        plain free again, the held ones stay with their sequences but are never matched again. Returns
        how many named blocks were forgotten."""
        if self.cache is None:
            return 0
        forgotten = len(self.cache)
        for block in list(self.cache.by_block):
            self.cache.forget(block)
        self._to_save.clear()  # KV of the old weights: none of it is kept
        self._to_load.clear()
        self._free.extend(self._evictable)
        self._free.extend(self._tail_prefix)
        self._evictable.clear()
        self._tail_prefix.clear()
        self._tails.clear()
        return forgotten

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Name the blocks of `seq` that became full and computed since the last call (O(1) each)."""
        if self.cache is None:
            return
        full = min(_known_computed(seq) // self.block_size, len(seq.block_table))
        for k in range(seq.num_registered_blocks, full):
            block_hash, parent = self._block_hash(seq, k), self._parent_hash(seq, k)
            self.cache.register(seq.block_table[k], block_hash, parent, self._tokens(seq, k))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    # ---- checking -----------------------------------------------------------------------------------
    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the pool's accounting is exact for the given live sequences."""
        owners: Counter[int] = Counter()
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} owns a block twice"
            owners.update(seq.block_table)
        free, evictable, tails = set(self._free), set(self._evictable), set(self._tail_prefix)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable and not (free | evictable) & tails, "a block is on two free lists"
        unheld = len(free) + len(evictable) + len(tails)
        assert unheld + len(owners) == self.num_blocks, (
            f"free ({len(free)}) + evictable ({len(evictable)}) + tails ({len(tails)}) + used ({len(owners)}) "
            f"!= total ({self.num_blocks})"
        )
        assert not (free | evictable | tails) & owners.keys(), "a free block is still owned"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == owners.get(block, 0), (
                f"block {block}: ref count {self.ref_counts[block]} but {owners.get(block, 0)} owners"
            )
        self._check_cache(free, evictable)

    def _check_cache(self, free: set[int], evictable: set[int]) -> None:
        if self.cache is None:
            assert not evictable and not self._tails, "cached blocks without a prefix cache"
            return
        assert len(self.cache.by_hash) == len(self.cache.by_block), "the cache's two maps disagree"
        for block_hash, block in self.cache.by_hash.items():
            assert 0 <= block < self.num_blocks, f"the cache names block {block}, outside the pool"
            assert self.cache.by_block[block].block_hash == block_hash, f"block {block} has two names"
            assert block not in free, f"cached block {block} is on the unnamed free list"
        for block in evictable:
            assert self.cache.is_cached(block), f"evictable block {block} has no name"
        assert len(self._tails) == len(self._tail_prefix), "the tail maps disagree"
        for prefix, (block, _) in self._tails.items():
            assert self._tail_prefix.get(block) == prefix, f"tail block {block} is filed twice"
            assert not self.cache.is_cached(block), f"tail block {block} also has a full-block name"


def _known_computed(seq: Sequence) -> int:
    """Computed (or scheduled) tokens whose ids are known: a pending token cannot name a block yet."""
    return min(seq.num_computed_tokens, len(seq.token_ids))
