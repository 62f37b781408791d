"""Routing policies: which replica of a pool gets a request.

Every policy has one interface: `choose(prompt, replicas)` returns a replica that may be sent
requests (raising `NoReplicaAvailable` when none may), and the gateway calls `on_start` / `on_finish`
around each request it sends, so the replica's in-flight count (and with it its load score, see
`replica.py`) is current between polls, and `on_eject` when a replica fails or leaves the pool.
Each choice is counted by the reason it was made in `policy.decisions` (and passed to an optional
`on_decision(reason, replica)` callback) for the gateway's /metrics.

- `round_robin`: the next routable replica after the last one chosen, in pool order.
- `least_load`: the smallest load score, vLLM's `waiting * 4 + running` plus this gateway's in-flight
  requests since the last poll; ties go to the lower KV cache usage, then to pool order.
- `prefix`: cache-aware, after SGLang's cache-aware router and llm-d's prefix-cache scorer. The policy
  remembers, per replica, the prompt blocks it sent there (`prefix_index.py`: chained block hashes,
  LRU-bounded). For each request, in order:
    1. Load wins when the pool is imbalanced: if the busiest and least busy routable replicas' load
       scores differ by more than `balance_abs_threshold` AND the busiest is above
       `balance_rel_threshold` times the least busy (SGLang's two conditions), the least loaded
       replica gets it (`load_balance`), whatever it has cached.
    2. Otherwise the replica holding the longest cached prefix of the prompt gets it when that prefix
       is at least `min_match_ratio` of the prompt's full blocks (`prefix_hit`); among replicas that
       hold equally long prefixes, the least loaded.
    3. Otherwise (`prefix_miss`) the least loaded, ties going to the replica with the fewest cached
       blocks (the most room: SGLang's choice of the smallest tree), so new prefixes spread.
  A request's `prompt_cache_key` (OpenAI's) heads its chain of blocks: requests with the same key and
  prefix meet on one replica, even prompts shorter than a block, and a prefix many keys share spreads
  by key instead of piling onto one replica.
  The chosen replica is then recorded as holding the prompt's blocks. An ejected replica's record is
  dropped (its cache is presumed lost), also when it comes back: a replica's `cache_epoch` changes on
  each ejection, so a record older than that is never trusted.

`route` is `choose` with what the choice knew: the reason, and how much of the prompt the chosen replica
was remembered to hold before this request (`Route.cached`; 0 where a policy remembers nothing), which
prefill/decode disaggregation weighs (disaggregation.py).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from llmserve.gateway.prefix_index import PrefixIndex, PromptKey, block_hashes
from llmserve.gateway.replica import Replica, ReplicaState

DecisionCallback = Callable[[str, Replica], None]

ROUND_ROBIN = "round_robin"
LEAST_LOAD = "least_load"
PREFIX_HIT = "prefix_hit"
PREFIX_MISS = "prefix_miss"
LOAD_BALANCE = "load_balance"
NO_REPLICA = "no_replica"


class NoReplicaAvailable(RuntimeError):
    """No replica of the pool may be sent requests (all ejected or draining, or the pool is empty)."""


@dataclass(frozen=True)
class Route:
    """A routing decision: the replica, why, and the length of the prompt's start (in the prompt's units:
    characters of a text, token ids of a list) the replica was remembered to hold in its cache before."""

    replica: Replica
    reason: str
    cached: int = 0


class RoutingPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, *, on_decision: DecisionCallback | None = None) -> None:
        self.decisions: Counter[str] = Counter()
        self._on_decision = on_decision

    def choose(self, prompt: PromptKey, replicas: Sequence[Replica], cache_key: str | None = None) -> Replica:
        """The replica for a request whose prompt is `prompt` (token ids, or text) and whose
        `prompt_cache_key` is `cache_key`."""
        return self.route(prompt, replicas, cache_key).replica

    def route(self, prompt: PromptKey, replicas: Sequence[Replica], cache_key: str | None = None) -> Route:
        """`choose`, with the reason and what the replica was remembered to hold of the prompt."""
        routable = [replica for replica in replicas if replica.routable]
        if not routable:
            self.decisions[NO_REPLICA] += 1
            raise NoReplicaAvailable(f"none of the {len(replicas)} replicas can take requests now.")
        route = self._pick(prompt, routable, replicas, cache_key)
        self.decisions[route.reason] += 1
        if self._on_decision is not None:
            self._on_decision(route.reason, route.replica)
        return route

    def on_start(self, replica: Replica) -> None:
        """The gateway sent a request to the replica."""
        replica.request_started()

    def on_finish(self, replica: Replica) -> None:
        """A request sent to the replica ended (done, failed or aborted)."""
        replica.request_finished()

    def on_eject(self, replica: Replica) -> None:  # noqa: B027 (a hook; most policies keep nothing)
        """The replica was ejected or left the pool: forget whatever was kept about it."""

    @abstractmethod
    def _pick(
        self, prompt: PromptKey, routable: list[Replica], replicas: Sequence[Replica], cache_key: str | None
    ) -> Route:
        """The replica among `routable` (never empty; in pool order), the reason, and what it holds."""


def _least_loaded(replicas: list[Replica]) -> Replica:
    """Smallest load score; ties to the lower KV cache usage, then the first in pool order."""
    return min(replicas, key=lambda replica: (replica.load_score, replica.kv_cache_usage))


class RoundRobinPolicy(RoutingPolicy):
    name = ROUND_ROBIN

    def __init__(self, *, on_decision: DecisionCallback | None = None) -> None:
        super().__init__(on_decision=on_decision)
        self._next = 0  # position in the pool to look from

    def _pick(
        self, prompt: PromptKey, routable: list[Replica], replicas: Sequence[Replica], cache_key: str | None
    ) -> Route:
        count = len(replicas)
        for step in range(count):
            position = (self._next + step) % count
            if replicas[position].routable:
                self._next = position + 1
                return Route(replicas[position], ROUND_ROBIN)
        raise AssertionError("unreachable: routable is not empty")


class LeastLoadPolicy(RoutingPolicy):
    name = LEAST_LOAD

    def _pick(
        self, prompt: PromptKey, routable: list[Replica], replicas: Sequence[Replica], cache_key: str | None
    ) -> Route:
        return Route(_least_loaded(routable), LEAST_LOAD)


class PrefixPolicy(RoutingPolicy):
    name = "prefix"

    def __init__(
        self,
        *,
        tokens_per_block: int = 16,
        chars_per_block: int = 64,
        min_match_ratio: float = 0.3,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
        max_blocks_per_replica: int = 65_536,
        on_decision: DecisionCallback | None = None,
    ) -> None:
        super().__init__(on_decision=on_decision)
        if tokens_per_block < 1 or chars_per_block < 1:
            raise ValueError("tokens_per_block and chars_per_block must be at least 1.")
        if not 0.0 <= min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio}.")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1.")
        self.tokens_per_block = tokens_per_block
        self.chars_per_block = chars_per_block
        self.min_match_ratio = min_match_ratio
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = PrefixIndex(max_blocks_per_replica)
        self._epochs: dict[str, int] = {}  # replica -> the cache_epoch its record belongs to

    def on_eject(self, replica: Replica) -> None:
        self.index.drop(replica.name)
        self._epochs.pop(replica.name, None)

    def imbalanced(self, replicas: Sequence[Replica]) -> bool:
        loads = [replica.load_score for replica in replicas]
        busiest, least = max(loads), min(loads)
        return (
            busiest - least > self.balance_abs_threshold
            and busiest > self.balance_rel_threshold * least
        )

    def _pick(
        self, prompt: PromptKey, routable: list[Replica], replicas: Sequence[Replica], cache_key: str | None
    ) -> Route:
        self._forget_lost_caches(replicas)
        hashes = block_hashes(prompt, tokens_per_block=self.tokens_per_block,
                              chars_per_block=self.chars_per_block, cache_key=cache_key)
        matched = self.index.matched_blocks(hashes)
        replica, reason = self._decide(hashes, matched, routable)
        self.index.insert(replica.name, hashes)
        self._epochs[replica.name] = replica.cache_epoch
        return Route(replica, reason, self._cached_length(prompt, matched.get(replica.name, 0), cache_key))

    def _decide(self, hashes: list[int], matched: dict[str, int], routable: list[Replica]) -> tuple[Replica, str]:
        if self.imbalanced(routable):
            return _least_loaded(routable), LOAD_BALANCE
        longest = max((matched.get(replica.name, 0) for replica in routable), default=0)
        if longest > 0 and longest >= self.min_match_ratio * len(hashes):
            holders = [replica for replica in routable if matched.get(replica.name, 0) == longest]
            return _least_loaded(holders), PREFIX_HIT
        return min(routable, key=lambda replica: (
            replica.load_score, self.index.size(replica.name), replica.kv_cache_usage)), PREFIX_MISS

    def _cached_length(self, prompt: PromptKey, matched_blocks: int, cache_key: str | None) -> int:
        """How much of the prompt `matched_blocks` leading blocks cover (a cache key's block covers none)."""
        prompt_blocks = max(0, matched_blocks - (cache_key is not None))
        size = self.chars_per_block if isinstance(prompt, str) else self.tokens_per_block
        return min(len(prompt), prompt_blocks * size)

    def _forget_lost_caches(self, replicas: Sequence[Replica]) -> None:
        for replica in replicas:
            epoch = self._epochs.get(replica.name)  # None: nothing recorded
            if epoch is not None and (replica.state is ReplicaState.EJECTED or epoch != replica.cache_epoch):
                self.on_eject(replica)


POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobinPolicy, LeastLoadPolicy, PrefixPolicy)
}


def policy_by_name(name: str, **options: object) -> RoutingPolicy:
    """A new policy of the given name (`round_robin`, `least_load`, `prefix`) with its options."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"Unknown routing policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}.")
    accepted = set(inspect.signature(policy.__init__).parameters) - {"self"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"Routing policy {name!r} does not take {', '.join(unknown)}; "
                         f"its options: {', '.join(sorted(accepted))}.")
    return policy(**options)  # type: ignore[arg-type]
