"""Exact behaviour of the batched sampler: filters, penalties, logprobs and seeded reproducibility."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    hash_uniforms,
    rng_key,
    rng_keys,
)

M32 = (1 << 32) - 1


def make_row(params: SamplingParams, seed: int = 0, sample_index: int = 0, prompt: Sequence[int] = (),
             output: Sequence[int] = (), banned: Sequence[int] = ()) -> SamplingRow:
    return SamplingRow(params, seed, sample_index, list(prompt), list(output), list(banned))


def run(logits: torch.Tensor, rows: list[SamplingRow], sampler: Sampler | None = None) -> SamplerOutput:
    metadata = SamplingMetadata.build(rows, logits.shape[1], logits.device)
    return (sampler or Sampler())(logits, metadata)


def draws(row_logits: torch.Tensor, params: SamplingParams, n: int, by: str = "seed") -> torch.Tensor:
    """n tokens sampled from one logits row, varying the seed (or the sample index) per draw."""
    logits = row_logits.expand(n, -1).contiguous()
    if by == "seed":
        rows = [make_row(params, seed=i) for i in range(n)]
    else:
        rows = [make_row(params, seed=12345, sample_index=i) for i in range(n)]
    return run(logits, rows).token_ids


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token with probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def reference_allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """vLLM's filters, the slow obvious way: top-k (ties kept), top-p on the renormalised rest, min-p."""
    scaled = logits.double() / params.temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < params.top_k < scaled.numel():
        keep &= scaled >= torch.sort(scaled, descending=True).values[params.top_k - 1]
    if params.top_p < 1.0:
        probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=0)
        order = torch.sort(probs, descending=True)
        before = torch.cumsum(order.values, dim=0) - order.values
        last = order.values[int((before < params.top_p).sum()) - 1]
        keep &= probs >= last
    if params.min_p > 0:
        probs = torch.softmax(scaled, dim=0)
        keep &= probs >= params.min_p * probs.max()
    return set(keep.nonzero().flatten().tolist())


def lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def reference_uniform(key: int, token: int) -> float:
    counter = (token * 0x9E3779B9 + key) & M32
    return ((lowbias32(counter) & ((1 << 23) - 1)) + 0.5) / 2**23


# -- greedy, banned tokens, penalties ------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    out = run(logits, [make_row(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert torch.equal(out.token_ids, logits.argmax(dim=1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_half_precision_logits_are_cast() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = run(logits, [make_row(SamplingParams(temperature=0.0, logprobs=1)) for _ in range(4)])
    assert torch.equal(out.token_ids, logits.float().argmax(dim=1))
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


def test_banned_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    greedy = run(logits, [make_row(SamplingParams(temperature=0.0), banned=[1, 2])])
    assert greedy.token_ids.tolist() == [3]
    tokens = draws(logits[0], SamplingParams(temperature=2.0), 1000)
    assert set(tokens.tolist()) <= {0, 1, 2, 3, 4}
    banned_rows = [make_row(SamplingParams(temperature=2.0), seed=i, banned=[1, 2, 99]) for i in range(1000)]
    banned = run(logits.expand(1000, -1).contiguous(), banned_rows).token_ids
    assert set(banned.tolist()) == {0, 3, 4}


def test_penalties_follow_the_formulas_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.5], [2.0, -1.0, 0.5, 3.0, -2.0, 1.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    rows = [
        make_row(params, prompt=[0, 1], output=[2, 2, 4]),
        make_row(SamplingParams(temperature=0.0), prompt=[0, 1], output=[2, 2, 4], banned=[3]),
    ]
    metadata = SamplingMetadata.build(rows, 6)
    processed = Sampler().processed_logits(logits, metadata)
    # token 0, 1: prompt only -> repetition penalty; 2: output x2; 4: output x1; 3, 5: untouched.
    expected = torch.tensor([
        [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0, -2.0 * 2 - 0.5 * 1 - 0.25, 1.5],
        [2.0, -1.0, 0.5, -math.inf, -2.0, 1.5],
    ])
    assert torch.equal(processed, expected)
    assert Sampler()(logits, metadata).token_ids.tolist() == [3, 0]
    assert torch.equal(logits[0], logits[1]), "the caller's logits must not be modified"


def test_logit_bias_is_added_per_row_after_bans_and_before_penalties() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    rows = [
        make_row(SamplingParams(temperature=0.0, logit_bias={1: 5.0, 3: -100.0})),
        make_row(SamplingParams(temperature=0.0, logit_bias={2: 100.0, 9: 1.0}), banned=[2]),  # 9: past the vocab
        make_row(SamplingParams(temperature=0.0, logit_bias={0: 1.5}, presence_penalty=0.5), output=[0]),
    ]
    metadata = SamplingMetadata.build(rows, 4)
    expected = torch.tensor([
        [2.0, -1.0 + 5.0, 0.5, 3.0 - 100.0],
        [2.0, -1.0, -math.inf, 3.0],  # a banned token stays banned whatever its bias
        [2.0 + 1.5 - 0.5, -1.0, 0.5, 3.0],
    ])
    assert torch.equal(Sampler().processed_logits(logits, metadata), expected)
    out = run(logits[:1], [make_row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={1: 5.0}))])
    assert out.token_ids.tolist() == [1]
    assert out.logprobs.tolist() == pytest.approx([torch.log_softmax(logits[0], 0)[1].item()])  # the model's own


def test_logit_bias_of_minus_100_leaves_a_token_undrawn() -> None:
    logits = torch.zeros(1, 5)
    rows = [make_row(SamplingParams(temperature=1.0, logit_bias={0: -100.0, 4: -100.0}), seed=i) for i in range(2000)]
    assert set(run(logits.expand(2000, -1).contiguous(), rows).token_ids.tolist()) == {1, 2, 3}


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 3)
    rows = [
        make_row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[0]),
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
        make_row(SamplingParams(temperature=0.0, frequency_penalty=0.01), output=[0, 0, 0, 0, 0, 0]),
    ]
    assert run(logits, rows).token_ids.tolist() == [1, 1, 0]


def test_penalty_counts_are_per_row() -> None:
    logits = torch.zeros(2, 4)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    rows = [make_row(params, output=[1, 1, 2]), make_row(params, output=[3, 7, -1])]
    processed = Sampler().processed_logits(logits, SamplingMetadata.build(rows, 4))
    assert processed.tolist() == [[0.0, -2.0, -1.0, 0.0], [0.0, 0.0, 0.0, -1.0]]


# -- filters -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=1.0, top_k=12, top_p=0.7),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.2),
    ],
    ids=["top_k", "top_p", "min_p", "top_k+top_p", "all"],
)
def test_filters_emit_exactly_the_allowed_set(params: SamplingParams) -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 1.5
    allowed = reference_allowed(logits, params)
    assert 1 < len(allowed) < 40
    seen = set(draws(logits, params, 2000).tolist()) | set(draws(logits, params, 2000, by="index").tolist())
    assert seen == allowed


def test_top_p_on_a_large_vocab_with_flat_and_peaked_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    flat = torch.randn(2000, generator=gen) * 0.5  # nucleus far beyond the first candidate guess
    peaked = torch.randn(2000, generator=gen) * 0.5
    peaked[:6] += 9.0
    params = SamplingParams(temperature=1.0, top_p=0.6)
    for logits in (flat, peaked):
        allowed = reference_allowed(logits, params)
        tokens = set(draws(logits, params, 600).tolist())
        assert tokens <= allowed
        assert len(tokens) > min(len(allowed), 600) // 3


def test_top_k_keeps_ties_with_the_kth_token() -> None:
    logits = torch.tensor([5.0, 5.0, 5.0, 5.0, 1.0, 1.0])
    tokens = draws(logits, SamplingParams(temperature=1.0, top_k=2), 400)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    logits = torch.tensor([0.45, 0.3, 0.25]).log()
    # within the top 2 the probabilities are 0.6 / 0.4: the mass before token 1 (0.6) already reaches 0.55
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55), 300).tolist()) == {0}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.55), 300).tolist()) == {0, 1}


def test_exact_score_ties_go_to_the_lowest_token_id_on_every_path() -> None:
    vocab = 4096
    for seed in range(50):
        key = rng_key(seed, 0)
        uniforms = hash_uniforms(torch.tensor([[key]], dtype=torch.int32), torch.arange(vocab))[0]
        values, counts = torch.unique(uniforms, return_counts=True)
        if bool((counts > 1).any()):
            break
    else:
        pytest.fail("no uniform collision found")
    pair = (uniforms == values[counts > 1][0]).nonzero().flatten()[:2].tolist()
    logits = torch.full((1, vocab), -math.inf)
    logits[0, pair] = 0.0
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=2)):
        assert run(logits, [make_row(params, seed=seed)]).token_ids.tolist() == [min(pair)]


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5))
    tokens = draws(logits, SamplingParams(temperature=5.0, top_k=1), 200)
    assert set(tokens.tolist()) == {int(logits.argmax())}


# -- distribution ----------------------------------------------------------------------------------------

# chi-square critical values at p = 1e-4 (df = 5 and 3): the draws are deterministic, so this is no flake
CHI2_DF5 = 25.74
CHI2_DF3 = 21.11


@pytest.mark.parametrize("by", ["seed", "index"])
def test_temperature_sampling_matches_softmax(by: str) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.7)
    tokens = draws(logits, params, 6000, by=by)
    assert chi_square(tokens, torch.softmax(logits / 0.7, dim=0)) < CHI2_DF5


def test_top_k_sampling_matches_renormalised_softmax() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, -3.0, 0.5])
    tokens = draws(logits, SamplingParams(temperature=1.5, top_k=4), 6000)
    probs = torch.softmax(logits / 1.5, dim=0)
    probs[[2, 4, 5, 6]] = 0.0
    assert chi_square(tokens, probs / probs.sum()) < CHI2_DF3


def test_uniforms_match_the_reference_hash() -> None:
    keys = [0, 1, -1, 2**31 - 1, -(2**31), rng_key(7, 3), rng_key(-5, 0)]
    tokens = [0, 1, 2, 31999, 151935, 2**20 + 3]
    got = hash_uniforms(torch.tensor(keys, dtype=torch.int32).unsqueeze(1), torch.tensor(tokens))
    want = torch.tensor([[reference_uniform(k & M32, t) for t in tokens] for k in keys], dtype=torch.float32)
    assert torch.equal(got, want)
    assert 0.0 < float(got.min()) and float(got.max()) < 1.0


def test_seed_folding_is_deterministic_and_spreads() -> None:
    seeds = [0, 1, -1, -(2**80), 2**32, 2**64, 2**64 + 1, 2**100 + 7, 12345]
    keys = [rng_key(s, 0) for s in seeds]
    assert keys == [rng_key(s, 0) for s in seeds]
    assert len(set(keys)) == len(keys)
    assert all(-(2**31) <= k < 2**31 for k in keys)
    assert len({rng_key(42, i) for i in range(1000)}) == 1000


# -- reproducibility -------------------------------------------------------------------------------------


def _fixed_rows(n: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(n, 500, generator=gen) * 1.5
    kinds = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.1, top_k=8),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, top_k=40),
    ]
    rows = [make_row(kinds[i % len(kinds)], seed=1000 + i, sample_index=i % 3) for i in range(n)]
    return logits, rows


def _distractors(n: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(n, 500, generator=gen) * 0.3
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4),
        SamplingParams(temperature=2.0, top_p=0.99),  # flat: forces the full-sort fallback
        SamplingParams(temperature=0.5, logprobs=3),
    ]
    rows = [make_row(kinds[i % len(kinds)], seed=i, output=[1, 2, 3], banned=[4]) for i in range(n)]
    return logits, rows


def test_same_seed_same_token_whatever_the_batch() -> None:
    logits, rows = _fixed_rows(64)
    alone = torch.cat([run(logits[i : i + 1], [rows[i]]).token_ids for i in range(64)])
    assert torch.equal(run(logits, rows).token_ids, alone)

    by_kind = [list(range(k, 64, 4)) for k in range(4)]  # each kind alone takes its own fast path
    for idx in by_kind:
        assert torch.equal(run(logits[idx], [rows[i] for i in idx]).token_ids, alone[idx])

    other_logits, others = _distractors(37)
    perm = torch.randperm(64 + 37, generator=torch.Generator().manual_seed(8))
    mixed_logits = torch.cat([logits, other_logits])[perm]
    mixed_rows = [(rows + others)[i] for i in perm.tolist()]
    mixed = run(mixed_logits, mixed_rows).token_ids
    mine = perm < 64
    assert torch.equal(mixed[mine], alone[perm[mine]])


def test_sampler_state_does_not_leak_between_calls() -> None:
    logits, rows = _fixed_rows(16)
    sampler = Sampler()
    first = run(logits, rows, sampler).token_ids
    run(*_distractors(50), sampler)
    assert torch.equal(run(logits, rows, sampler).token_ids, first)


def test_different_seeds_and_indices_differ() -> None:
    logits = torch.zeros(1000)
    by_seed = draws(logits, SamplingParams(temperature=1.0), 200)
    by_index = draws(logits, SamplingParams(temperature=1.0), 200, by="index")
    assert len(set(by_seed.tolist())) > 150
    assert len(set(by_index.tolist())) > 150
    assert not torch.equal(by_seed, by_index)


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(9))
    rows = [make_row(SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=3), seed=i) for i in range(6)]
    tokens = run(logits, rows).token_ids
    top3 = logits.topk(3, dim=1).indices
    for i in range(6):
        if i % 2:
            assert tokens[i] == logits[i].argmax()
        else:
            assert tokens[i] in top3[i]


# -- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_top_k_of_max_request() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(10)) * 3
    rows = [
        make_row(SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.5), seed=1, prompt=[0, 1]),
        make_row(SamplingParams(temperature=0.0, logprobs=5), banned=[int(logits[1].argmax())]),
        make_row(SamplingParams(temperature=1.0, top_k=3)),
        make_row(SamplingParams(temperature=0.0, logprobs=0)),
    ]
    out = run(logits, rows)
    expected = torch.log_softmax(logits, dim=1)
    assert out.logprobs is not None and out.top_logprobs is not None and out.top_logprob_ids is not None
    assert out.logprobs.shape == (4,) and out.top_logprob_ids.shape == (4, 5)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    top = expected.topk(5, dim=1)
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.top_logprob_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32


def test_zero_logprobs_gives_empty_top_k() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(11))
    out = run(logits, [make_row(SamplingParams(temperature=0.0, logprobs=0)), make_row(SamplingParams())])
    assert out.logprobs is not None and out.top_logprob_ids is not None and out.top_logprobs is not None
    assert out.top_logprob_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)


def test_rejects_mismatched_batch() -> None:
    metadata = SamplingMetadata.build([make_row(SamplingParams())], 10)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), metadata)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 11), metadata)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_the_same_tokens_as_cpu() -> None:
    logits, rows = _fixed_rows(64)
    other_logits, others = _distractors(20)
    logits, rows = torch.cat([logits, other_logits]), rows + others
    cpu = run(logits, rows)
    cuda = run(logits.cuda(), rows)
    assert cuda.token_ids.device.type == "cuda"
    assert torch.equal(cuda.token_ids.cpu(), cpu.token_ids)
    assert cuda.logprobs is not None and cpu.logprobs is not None
    torch.testing.assert_close(cuda.logprobs.cpu(), cpu.logprobs)


def test_batched_keys_equal_the_scalar_keys() -> None:
    seeds = [0, 1, -1, -(2**80), 2**63 - 1, 2**64 + 1, 2**100 + 7, 12345, 12345]
    indices = [0, 1, 2**40, 7, 0, 1023, 5, 0, 1]
    keys = rng_keys(seeds, indices)
    assert keys.dtype == np.int32
    assert keys.tolist() == [rng_key(s, i) for s, i in zip(seeds, indices, strict=True)]
    assert rng_keys([], []).tolist() == []
