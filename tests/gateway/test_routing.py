"""The gateway's routing policies, without HTTP: replicas are `Replica` objects whose load the tests set."""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import pytest

from llmserve.gateway.prefix_index import PrefixIndex, block_hashes
from llmserve.gateway.replica import Replica, ReplicaState
from llmserve.gateway.routing import (
    LOAD_BALANCE,
    NO_REPLICA,
    PREFIX_HIT,
    PREFIX_MISS,
    NoReplicaAvailable,
    PrefixPolicy,
    RoutingPolicy,
    policy_by_name,
)

BLOCK = 16


def pool(count: int = 3) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000") for i in range(count)]


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(32_000) for _ in range(count)]


def route_and_finish(policy: RoutingPolicy, prompt: list[int] | str, replicas: list[Replica]) -> Replica:
    """One request that ends before the next starts."""
    replica = policy.choose(prompt, replicas)
    policy.on_start(replica)
    policy.on_finish(replica)
    return replica


# --- replica load ---------------------------------------------------------------------------------

def test_load_score_is_vllms_score_plus_in_flight_since_the_last_report() -> None:
    replica = Replica("http://a")
    replica.report_load(running=3, waiting=2, kv_cache_usage=0.5)
    assert replica.load_score == 2 * 4 + 3
    replica.request_started()
    replica.request_started()
    assert replica.load_score == 13  # sent since the report: not in the replica's figures yet
    replica.report_load(running=5, waiting=2, kv_cache_usage=0.5)  # now they are
    assert replica.load_score == 13
    replica.request_finished()
    assert replica.load_score == 12
    replica.report_load(running=0, waiting=0, kv_cache_usage=0.0)
    replica.request_finished()
    assert replica.load_score == 0  # never negative
    with pytest.raises(RuntimeError):
        replica.request_finished()
    with pytest.raises(ValueError, match="kv_cache_usage"):
        replica.report_load(running=0, waiting=0, kv_cache_usage=1.5)


# --- round robin ----------------------------------------------------------------------------------

def test_round_robin_cycles_over_routable_replicas_only() -> None:
    a, b, c, d = pool(4)
    policy = policy_by_name("round_robin")
    replicas = [a, b, c, d]
    assert [policy.choose("x", replicas) for _ in range(5)] == [a, b, c, d, a]
    b.eject()
    d.drain()
    assert [policy.choose("x", replicas) for _ in range(4)] == [c, a, c, a]
    b.readmit()
    assert [policy.choose("x", replicas) for _ in range(3)] == [b, c, a]
    assert policy.decisions == {"round_robin": 12}


# --- least load -----------------------------------------------------------------------------------

def test_least_load_picks_the_smallest_score_and_counts_in_flight() -> None:
    a, b, c = pool()
    a.report_load(running=3, waiting=0, kv_cache_usage=0.1)  # 3
    b.report_load(running=0, waiting=1, kv_cache_usage=0.1)  # 4: a waiting request weighs 4
    c.report_load(running=2, waiting=0, kv_cache_usage=0.1)  # 2
    policy = policy_by_name("least_load")
    assert policy.choose("x", [a, b, c]) is c
    policy.on_start(c)
    policy.on_start(c)  # c: 4
    assert policy.choose("x", [a, b, c]) is a
    policy.on_start(a)
    policy.on_start(a)  # a: 5; b and c tie at 4: pool order
    assert policy.choose("x", [a, b, c]) is b
    b.kv_cache_usage = 0.9  # the tie goes to the emptier KV cache
    assert policy.choose("x", [a, b, c]) is c
    assert policy.decisions == {"least_load": 4}


def test_a_burst_between_polls_spreads_over_the_pool() -> None:
    replicas = pool()
    policy = policy_by_name("least_load")
    for _ in range(9):  # no poll in between: only the gateway's own in-flight counts move
        policy.on_start(policy.choose("x", replicas))
    assert [replica.in_flight for replica in replicas] == [3, 3, 3]


def test_no_routable_replica_is_an_error_and_counted() -> None:
    a, b = pool(2)
    a.eject()
    b.drain()
    for name in ("round_robin", "least_load", "prefix"):
        policy = policy_by_name(name)
        with pytest.raises(NoReplicaAvailable):
            policy.choose("x", [a, b])
        with pytest.raises(NoReplicaAvailable):
            policy.choose("x", [])
        assert policy.decisions == {NO_REPLICA: 2}


# --- prefix index ---------------------------------------------------------------------------------

def test_block_hashes_chain_full_blocks_of_tokens_or_text() -> None:
    ids = list(range(40))
    hashes = block_hashes(ids, tokens_per_block=BLOCK, chars_per_block=64)
    assert len(hashes) == 2  # the partial third block is left out
    assert block_hashes(ids[:32] + [7] * 8, tokens_per_block=BLOCK, chars_per_block=64) == hashes
    repeated = block_hashes([5] * 32, tokens_per_block=BLOCK, chars_per_block=64)
    assert repeated[0] != repeated[1]  # the same block after a different prefix is another node
    assert block_hashes(ids[:15], tokens_per_block=BLOCK, chars_per_block=64) == []
    text = "You are a helpful assistant. " * 10  # 290 characters: 4 blocks of 64
    assert len(block_hashes(text, tokens_per_block=BLOCK, chars_per_block=64)) == 4
    assert block_hashes(text + "Hi", tokens_per_block=BLOCK, chars_per_block=64) == block_hashes(
        text, tokens_per_block=BLOCK, chars_per_block=64)


def test_matched_blocks_counts_each_replicas_leading_blocks() -> None:
    index = PrefixIndex(max_blocks_per_replica=100)
    prompt = block_hashes(list(range(80)), tokens_per_block=BLOCK, chars_per_block=64)  # 5 blocks
    other = block_hashes(list(range(32)) + [9] * 48, tokens_per_block=BLOCK, chars_per_block=64)
    index.insert("a", prompt)
    index.insert("b", other)  # shares the first 2 blocks
    index.insert("c", prompt[:1])
    assert index.matched_blocks(prompt) == {"a": 5, "b": 2, "c": 1}
    assert index.matched_blocks(other) == {"a": 2, "b": 5, "c": 1}
    assert index.matched_blocks([123]) == {}
    index.drop("a")
    assert index.matched_blocks(prompt) == {"b": 2, "c": 1}
    assert index.size("a") == 0 and index.total_size == 6


# --- prefix policy --------------------------------------------------------------------------------

def test_prefix_requests_sharing_a_system_prompt_stick_to_one_replica() -> None:
    rng = random.Random(1)
    system = tokens(rng, 320)
    replicas = pool()
    policy = PrefixPolicy()
    chosen = {route_and_finish(policy, system + tokens(rng, 50), replicas) for _ in range(30)}
    assert len(chosen) == 1
    assert policy.decisions == {PREFIX_MISS: 1, PREFIX_HIT: 29}


def test_prefix_works_on_text_too() -> None:
    replicas = pool()
    policy = PrefixPolicy()
    system = "You are the support assistant of ACME. Answer briefly and politely. " * 8
    chosen = {route_and_finish(policy, f"{system}user {i}: where is my order?", replicas) for i in range(10)}
    assert len(chosen) == 1
    assert policy.decisions == {PREFIX_MISS: 1, PREFIX_HIT: 9}


def test_prefix_distinct_tenants_spread_then_stick() -> None:
    rng = random.Random(2)
    systems = [tokens(rng, 320) for _ in range(3)]
    replicas = pool()
    policy = PrefixPolicy()
    first = [route_and_finish(policy, system + tokens(rng, 20), replicas) for system in systems]
    assert len(set(first)) == 3  # equal load: a new prefix goes where the least is cached
    again = [route_and_finish(policy, system + tokens(rng, 20), replicas) for system in systems * 3]
    assert again == first * 3
    assert policy.decisions == {PREFIX_MISS: 3, PREFIX_HIT: 9}


def test_prefix_short_or_unmatched_prompts_go_to_the_least_loaded() -> None:
    rng = random.Random(3)
    a, b, c = pool()
    policy = PrefixPolicy(min_match_ratio=0.5)
    system = tokens(rng, 64)  # 4 blocks
    assert route_and_finish(policy, system + tokens(rng, 16), [a, b, c]) is a  # 5 blocks cached on a
    b.report_load(running=1, waiting=0, kv_cache_usage=0.0)
    # 4 of 10 blocks match a: under the ratio, so the least loaded with the most room, c
    assert policy.choose(system + tokens(rng, 96), [a, b, c]) is c
    # no full block, nothing to match: the least loaded with the fewest cached blocks (a: 5, c: 10)
    assert policy.choose(tokens(rng, 10), [a, b, c]) is a
    assert policy.decisions == {PREFIX_MISS: 3}


def test_prefix_cache_key_keeps_a_key_on_one_replica_and_spreads_a_shared_prefix_by_key() -> None:
    rng = random.Random(5)
    replicas = pool()
    policy = PrefixPolicy()
    users = [f"user-{i}" for i in range(3)]

    def route(prompt: list[int], key: str) -> Replica:
        replica = policy.choose(prompt, replicas, cache_key=key)
        policy.on_start(replica)
        policy.on_finish(replica)
        return replica

    # Prompts shorter than a block have nothing to match, but their key does.
    first = [route(tokens(rng, 5), user) for user in users]
    assert len(set(first)) == 3
    assert [route(tokens(rng, 5), user) for user in users * 3] == first * 3
    # One long prefix under three keys: three chains, one replica each, where without keys one holds it.
    system = tokens(rng, 320)
    keyed = [route(system + tokens(rng, 10), user) for user in users]
    assert len(set(keyed)) == 3 and keyed == first
    assert len({route_and_finish(policy, system + tokens(rng, 10), replicas) for _ in range(3)}) == 1
    assert block_hashes([1] * 40, tokens_per_block=BLOCK, chars_per_block=64, cache_key="k")[1:] != block_hashes(
        [1] * 40, tokens_per_block=BLOCK, chars_per_block=64)


def test_prefix_load_term_overrides_affinity_past_the_threshold_only() -> None:
    rng = random.Random(4)
    system = tokens(rng, 320)
    a, b, c = pool()
    policy = PrefixPolicy(balance_abs_threshold=16, balance_rel_threshold=1.5)
    assert route_and_finish(policy, system + tokens(rng, 20), [a, b, c]) is a

    def route_with(loads: tuple[int, int, int]) -> Replica:
        for replica, running in zip((a, b, c), loads, strict=True):
            replica.report_load(running=running, waiting=0, kv_cache_usage=0.0)
        return policy.choose(system + tokens(rng, 20), [a, b, c])

    assert route_with((16, 0, 0)) is a  # a difference of 16 is not past 16
    assert route_with((80, 60, 61)) is a  # past 16, but 80 is not past 1.5 x 60
    assert policy.decisions[LOAD_BALANCE] == 0
    assert route_with((17, 0, 1)) is b  # past both: load wins over the cached prefix
    assert route_with((100, 70, 60)) is c
    assert policy.decisions == {PREFIX_MISS: 1, PREFIX_HIT: 2, LOAD_BALANCE: 2}
    # b and c got the prompt too; with the imbalance gone, the least loaded of the three holders wins
    assert route_with((5, 4, 3)) is c
    assert policy.decisions[PREFIX_HIT] == 3


def test_prefix_memory_stays_under_the_bound_under_many_distinct_prompts() -> None:
    rng = random.Random(5)
    replicas = pool(2)
    policy = PrefixPolicy(max_blocks_per_replica=50)
    for _ in range(400):
        route_and_finish(policy, tokens(rng, 16 * rng.randrange(1, 70)), replicas)  # up to 69 blocks
        assert all(policy.index.size(replica.name) <= 50 for replica in replicas)
    assert policy.index.total_size == 100
    assert policy.index.distinct_blocks == 100  # nothing left behind by evictions


def test_prefix_index_evicts_tails_before_the_prefix_they_share() -> None:
    rng = random.Random(7)
    index = PrefixIndex(max_blocks_per_replica=50)
    system = tokens(rng, 64)  # 4 blocks
    prompts = [system + tokens(rng, 160) for _ in range(100)]  # 14 blocks each, tails all distinct
    for prompt in prompts:
        index.insert("a", block_hashes(prompt, tokens_per_block=BLOCK, chars_per_block=64))
        assert index.size("a") <= 50
    last = block_hashes(prompts[-1], tokens_per_block=BLOCK, chars_per_block=64)
    assert index.matched_blocks(last) == {"a": 14}
    first = block_hashes(prompts[0], tokens_per_block=BLOCK, chars_per_block=64)
    assert index.matched_blocks(first) == {"a": 4}  # its tail is gone, the shared system prompt is not


def test_prefix_ejected_replicas_are_never_chosen_and_their_records_dropped() -> None:
    rng = random.Random(6)
    system = tokens(rng, 320)
    a, b, c = pool()
    policy = PrefixPolicy()
    assert route_and_finish(policy, system + tokens(rng, 20), [a, b, c]) is a
    assert policy.index.size(a.name) > 0
    a.eject()
    for _ in range(5):
        assert route_and_finish(policy, system + tokens(rng, 20), [a, b, c]) is b
    assert policy.index.size(a.name) == 0
    a.readmit()
    b.drain()
    assert route_and_finish(policy, system + tokens(rng, 20), [a, b, c]) is a  # a miss: a came back empty
    # ejected and back between two requests: what was recorded before is stale all the same
    a.eject()
    a.readmit()
    a.report_load(running=1, waiting=0, kv_cache_usage=0.0)  # otherwise a tie with c, which a wins
    assert route_and_finish(policy, system + tokens(rng, 20), [a, c]) is c  # a miss, not a hit on a
    assert policy.index.size(a.name) == 0
    assert policy.decisions == {PREFIX_MISS: 4, PREFIX_HIT: 4}
    # the explicit hook drops at once
    policy.on_eject(c)
    assert policy.index.size(c.name) == 0


def test_decisions_reach_the_callback() -> None:
    seen: list[tuple[str, str]] = []
    policy = policy_by_name("prefix", on_decision=lambda reason, replica: seen.append((reason, replica.name)))
    replicas = pool()
    prompt = list(range(64))
    route_and_finish(policy, prompt, replicas)
    route_and_finish(policy, prompt, replicas)
    assert seen == [(PREFIX_MISS, replicas[0].name), (PREFIX_HIT, replicas[0].name)]


def test_policy_by_name() -> None:
    assert policy_by_name("round_robin").name == "round_robin"
    assert policy_by_name("least_load").name == "least_load"
    prefix = policy_by_name("prefix", balance_abs_threshold=4, max_blocks_per_replica=10)
    assert isinstance(prefix, PrefixPolicy) and prefix.balance_abs_threshold == 4
    assert prefix.index.max_blocks_per_replica == 10
    with pytest.raises(ValueError, match="Unknown routing policy 'random'; choose one of: least_load, prefix, "
                                         "round_robin"):
        policy_by_name("random")
    with pytest.raises(ValueError, match="'round_robin' does not take block_size"):
        policy_by_name("round_robin", block_size=16)
    with pytest.raises(ValueError, match="min_match_ratio"):
        policy_by_name("prefix", min_match_ratio=2.0)


# --- simulation: 8 tenants, Zipf popularity, 3 replicas -------------------------------------------

TENANTS = 8
SYSTEM_TOKENS = 1000
CACHED_TENANTS = 3  # each replica's KV cache holds three tenants' system prompts (LRU)
DURATION = 72  # a request finishes after this many further requests were routed


def simulate(policy: RoutingPolicy, *, replica_count: int, cached_tenants: int,
             requests: int = 1500) -> tuple[float, float]:
    """The fraction of requests sent where their tenant's prompt was still cached, and the largest
    ratio of the busiest replica's in-flight count to the mean once the pool is in its steady state."""
    rng = random.Random(0)
    systems = [tokens(rng, SYSTEM_TOKENS) for _ in range(TENANTS)]
    popularity = [1 / (rank + 1) ** 1.1 for rank in range(TENANTS)]  # Zipf: the top tenant ~39%
    replicas = pool(replica_count)
    caches: dict[str, OrderedDict[int, None]] = {replica.name: OrderedDict() for replica in replicas}
    in_flight: deque[Replica] = deque()
    hits, worst_ratio = 0, 0.0
    for _ in range(requests):
        tenant = rng.choices(range(TENANTS), popularity)[0]
        replica = policy.choose(systems[tenant] + tokens(rng, 40), replicas)
        policy.on_start(replica)
        cache = caches[replica.name]
        hits += tenant in cache
        cache[tenant] = None
        cache.move_to_end(tenant)
        if len(cache) > cached_tenants:
            cache.popitem(last=False)
        in_flight.append(replica)
        if len(in_flight) > DURATION:
            policy.on_finish(in_flight.popleft())
            mean = DURATION / replica_count
            worst_ratio = max(worst_ratio, max(r.in_flight for r in replicas) / mean)
    return hits / requests, worst_ratio


def test_simulation_prefix_keeps_tenants_warm_and_load_even() -> None:
    blocks_per_prompt = (SYSTEM_TOKENS + 40) // BLOCK
    one_replica, _ = simulate(policy_by_name("round_robin"), replica_count=1,
                              cached_tenants=3 * CACHED_TENANTS)
    prefix_policy = PrefixPolicy(max_blocks_per_replica=CACHED_TENANTS * blocks_per_prompt)
    prefix, prefix_ratio = simulate(prefix_policy, replica_count=3, cached_tenants=CACHED_TENANTS)
    round_robin, _ = simulate(policy_by_name("round_robin"), replica_count=3, cached_tenants=CACHED_TENANTS)

    assert one_replica == (1500 - TENANTS) / 1500  # the pool's whole cache in one replica: every tenant stays
    assert prefix >= 0.9 * one_replica
    assert prefix_ratio <= 1.5
    assert round_robin <= prefix - 0.25
    assert prefix_policy.decisions[LOAD_BALANCE] > 0  # the top tenant alone is more than a replica's share
    assert sum(prefix_policy.decisions.values()) == 1500


def test_replica_states() -> None:
    replica = Replica("http://a")
    assert replica.routable and replica.state is ReplicaState.HEALTHY
    replica.drain()
    assert not replica.routable and replica.cache_epoch == 0
    replica.eject()
    replica.eject()
    assert replica.state is ReplicaState.EJECTED and replica.cache_epoch == 1
    replica.readmit()
    assert replica.routable
