"""Batched token sampler: penalties, temperature, top-k / top-p / min-p and reproducible seeded sampling.

The engine builds one `SamplingRow` per logits row, turns them into a `SamplingMetadata` once per
step and calls `Sampler()(logits, metadata)`. Everything on the hot path is vectorised over the batch.

Randomness is counter based: the noise for vocabulary entry `v` of a row is a 32-bit integer hash
(murmur-style "lowbias32") of `v` keyed by a 32-bit key derived from `(seed, sample_index)`, turned into
a uniform in (0, 1) and used in an exponential race (`argmax(p_v / E_v)`, `E_v = -ln U_v`, which draws
`v` with probability `p_v`). The noise of a row therefore depends on nothing but its own seed and
sample index, so a request draws the same token whatever else is in the batch, in whichever order, and
on CPU or CUDA alike (pure int32 math, then float ops; the int32 products wrap modulo 2**32 on both).
The only way two placements could disagree is a last-ulp difference of a vectorised exp/log deciding an
exact near-tie between two tokens' scores.

Filters are expressed as one per-row threshold on the scaled logits (a token survives when its logit is
at least the threshold), so tokens tied with the last kept one are always kept too, and the result
never depends on how a sort orders equal values. Top-k / top-p look only at the best few candidates
(`topk`) and fall back to a full sort just for the rows whose nucleus does not fit; when every row's
kept set fits, the noise is computed for the candidates only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmserve.sampling.params import SamplingParams

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "hash_uniforms",
    "rng_key",
    "rng_keys",
]

_M64 = (1 << 64) - 1
_NEGATIVE_SEED_TAG = 0xD1B54A32D192ED03

# lowbias32 (https://nullprogram.com/blog/2018/07/31/) constants, as signed int32 where needed.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_GOLDEN32 = 0x9E3779B9 - (1 << 32)  # Weyl step that spreads consecutive token ids over the key space
_MANTISSA_MASK = (1 << 23) - 1
_ONE_BITS = 0x3F800000  # float32 1.0
_UNIFORM_OFFSET = 1.0 - 2.0**-24  # exactly representable in float32

_NUCLEUS_CANDIDATES = 128
_MASK_PENALTY = np.array([-np.inf, 0.0], dtype=np.float32)  # added to a logit whose allowed bit is 0 / 1  # first guess at how many candidates a top-p-only row needs


# ----------------------------------------------------------------------------------------------------
# Public data types
# ----------------------------------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """What the sampler needs to know about one logits row; built by the engine."""

    params: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    ranks: torch.Tensor | None = None  # of each sampled token among its row's raw logits (1 = the best)


# ----------------------------------------------------------------------------------------------------
# Counter-based RNG
# ----------------------------------------------------------------------------------------------------


def _mix64(z: int) -> int:
    """splitmix64: a bijective 64-bit mixer."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _fold_seed(seed: int) -> int:
    """Any Python int -> 64 bits, deterministically (identity on [0, 2**64))."""
    negative = seed < 0
    rest = ~seed if negative else seed
    folded = rest & _M64
    rest >>= 64
    while rest:
        folded = _mix64(folded) ^ (rest & _M64)
        rest >>= 64
    return _mix64(folded ^ _NEGATIVE_SEED_TAG) if negative else folded


@functools.lru_cache(maxsize=1 << 16)
def _seed_base(seed: int) -> int:
    """The per-seed half of a key: constant for a request, so computed once (hot in the step loop)."""
    return _mix64(_fold_seed(int(seed)))


def rng_key(seed: int, sample_index: int) -> int:
    """The signed 32-bit key of the noise used to sample token `sample_index` of a request."""
    z = _mix64(_seed_base(seed) ^ (int(sample_index) & _M64))
    key = z >> 32
    return key - (1 << 32) if key >= 1 << 31 else key


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """`_mix64` over a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64, as the mixer needs)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def rng_keys(seeds: Sequence[int], sample_indices: Sequence[int]) -> np.ndarray:
    """`rng_key` of each (seed, sample index) pair, as int32, vectorised over the batch."""
    count = len(seeds)
    bases = np.fromiter(map(_seed_base, seeds), dtype=np.uint64, count=count)
    indices = np.fromiter(sample_indices, dtype=np.int64, count=count).astype(np.uint64)
    with np.errstate(over="ignore"):
        return (_mix64_array(bases ^ indices) >> np.uint64(32)).astype(np.uint32).view(np.int32)


def _xorshift_right_(x: torch.Tensor, shift: int, tmp: torch.Tensor) -> None:
    """x ^= x >>> shift (logical shift of the 32-bit pattern), in place."""
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp.bitwise_and_((1 << (32 - shift)) - 1)
    x.bitwise_xor_(tmp)


def _lowbias32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """In-place lowbias32 over int32 tensors (products wrap modulo 2**32)."""
    _xorshift_right_(x, 16, tmp)
    x.mul_(_MUL1)
    _xorshift_right_(x, 15, tmp)
    x.mul_(_MUL2)
    _xorshift_right_(x, 16, tmp)


def _token_counters(token_ids: torch.Tensor) -> torch.Tensor:
    """Token ids -> int32 counters (token_id * golden ratio, wrapping)."""
    return token_ids.to(torch.int32).mul_(_GOLDEN32)


def _uniforms_into(counters: torch.Tensor, keys: torch.Tensor, bits: torch.Tensor, tmp: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """Uniforms (k + 0.5) / 2**23 in (0, 1), k = low 23 bits of hash(counter + key), written into `out`.

    The 23 bits become the mantissa of a float in [1, 2); subtracting 1 - 2**-24 is exact (Sterbenz).
    """
    torch.add(counters, keys, out=bits)
    _lowbias32_(bits, tmp)
    bits.bitwise_and_(_MANTISSA_MASK).bitwise_or_(_ONE_BITS)
    return torch.sub(bits.view(torch.float32), _UNIFORM_OFFSET, out=out)


def hash_uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The sampler's uniforms for `token_ids` ([R, M] or [M]) under per-row int32 `keys` ([R, 1])."""
    counters = _token_counters(token_ids)
    shape = torch.broadcast_shapes(counters.shape, keys.shape)
    bits = torch.empty(shape, dtype=torch.int32, device=keys.device)
    tmp = torch.empty_like(bits)
    out = torch.empty(shape, dtype=torch.float32, device=keys.device)
    return _uniforms_into(counters, keys, bits, tmp, out)


# ----------------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------------


@dataclass
class _RandomMetadata:
    """Per-row tensors for the rows that are sampled (temperature > 0), in their batch order."""

    rows: torch.Tensor | None  # [R] int64 positions in the batch; None when every row is random
    temperature: torch.Tensor  # [R, 1] float32
    keys: torch.Tensor  # [R, 1] int32 RNG keys
    log_min_p: torch.Tensor | None  # [R, 1] float32, -inf where min_p is off
    kp_rows: torch.Tensor | None  # [Rk] int64 positions among the random rows using top-k/top-p; None: all
    top_k: torch.Tensor | None  # [Rk, 1] int64, 0 where off
    top_p: torch.Tensor | None  # [Rk, 1] float32, 1 where off
    num_candidates: int  # first topk width tried for the top-k/top-p rows (0: no such row)
    needs_row_total: bool  # some row uses top-p without top-k (needs the full-vocab normaliser)

    @property
    def uses_top_k_top_p(self) -> bool:
        return self.num_candidates > 0


@dataclass
class _PenaltyMetadata:
    """Sparse penalty terms: flat (row * vocab + token) indices with per-entry coefficients."""

    seen_index: torch.Tensor | None  # distinct prompt+output entries of rows with repetition_penalty != 1
    repetition: torch.Tensor | None  # [len(seen_index)] float32
    output_index: torch.Tensor | None  # distinct output entries of rows with frequency/presence penalties
    output_counts: torch.Tensor | None  # [len(output_index)] float32 occurrence counts
    frequency: torch.Tensor | None  # [len(output_index)] float32
    presence: torch.Tensor | None  # [len(output_index)] float32


def _k_of(params: SamplingParams, vocab_size: int) -> int:
    return params.top_k if 0 < params.top_k < vocab_size else 0


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory, asynchronously: a copy from pageable
    memory would wait for the step still running on the device and undo the overlap. The one way every
    step input reaches the device (the runner's too)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _flat_token_index(rows: Sequence[tuple[int, Sequence[int]]], vocab_size: int) -> torch.Tensor:
    """(row, token ids) pairs -> int64 flat indices row * vocab + token (out-of-range ids dropped), CPU."""
    lengths = np.fromiter((len(tokens) for _, tokens in rows), dtype=np.int64, count=len(rows))
    flat = chain.from_iterable(tokens for _, tokens in rows)
    tokens = np.fromiter(flat, dtype=np.int64, count=int(lengths.sum()))
    row_ids = np.repeat(np.fromiter((r for r, _ in rows), dtype=np.int64, count=len(rows)), lengths)
    keep = (tokens >= 0) & (tokens < vocab_size)
    return torch.from_numpy(row_ids[keep] * vocab_size + tokens[keep])


def _per_entry(values: list[float], index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Broadcast one float per batch row onto flat indices."""
    return torch.tensor(values, dtype=torch.float32)[torch.div(index, vocab_size, rounding_mode="floor")]


def _build_penalties(rows: Sequence[SamplingRow], vocab_size: int,
                     device: torch.device) -> _PenaltyMetadata | None:
    rep_rows = [(i, r) for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    out_rows = [
        (i, r) for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if not rep_rows and not out_rows:
        return None
    meta = _PenaltyMetadata(None, None, None, None, None, None)
    if rep_rows:
        seen = [(i, tokens) for i, r in rep_rows for tokens in (r.prompt_token_ids, r.output_token_ids)]
        index = torch.unique(_flat_token_index(seen, vocab_size))
        meta.seen_index = to_device(index, device)
        meta.repetition = to_device(_per_entry([r.params.repetition_penalty for r in rows], index, vocab_size), device)
    if out_rows:
        index, counts = torch.unique(
            _flat_token_index([(i, r.output_token_ids) for i, r in out_rows], vocab_size), return_counts=True
        )
        meta.output_index = to_device(index, device)
        meta.output_counts = to_device(counts.to(torch.float32), device)
        meta.frequency = to_device(_per_entry([r.params.frequency_penalty for r in rows], index, vocab_size), device)
        meta.presence = to_device(_per_entry([r.params.presence_penalty for r in rows], index, vocab_size), device)
    return meta


def _build_bias(rows: Sequence[SamplingRow], vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(flat indices, values) of every row's logit_bias, on the CPU; (None, None) when no row has one."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return None, None
    index = _flat_token_index([(i, list(bias)) for i, bias in biased], vocab_size)
    values = [value for _, bias in biased for token, value in bias.items() if token < vocab_size]
    return index, torch.tensor(values, dtype=torch.float32)


def _nucleus_only(ks: list[int], ps: list[float]) -> bool:
    """Whether some row uses top-p without top-k."""
    return any(k == 0 and p < 1.0 for k, p in zip(ks, ps, strict=True))


def _initial_candidates(ks: list[int], ps: list[float], vocab_size: int) -> int:
    """How many top candidates to try first for the top-k/top-p rows."""
    width = max(ks) + 1 if any(ks) else 0
    if _nucleus_only(ks, ps):
        width = max(width, _NUCLEUS_CANDIDATES)
    return min(width, vocab_size)


def _build_random(rows: Sequence[SamplingRow], positions: list[int], batch_size: int, vocab_size: int,
                  device: torch.device) -> _RandomMetadata:
    params = [rows[i].params for i in positions]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), device).unsqueeze(1)

    ks = [_k_of(p, vocab_size) for p in params]
    kp = [j for j, p in enumerate(params) if ks[j] > 0 or p.top_p < 1.0]
    kp_ks = [ks[j] for j in kp]
    kp_ps = [params[j].top_p for j in kp]
    min_ps = [p.min_p for p in params]
    return _RandomMetadata(
        rows=None if len(positions) == batch_size else to_device(torch.tensor(positions, dtype=torch.int64), device),
        temperature=column([p.temperature for p in params], torch.float32),
        keys=to_device(torch.from_numpy(
            rng_keys([rows[i].seed for i in positions], [rows[i].sample_index for i in positions])
        ), device).unsqueeze(1),
        log_min_p=column([math.log(m) if m > 0 else -math.inf for m in min_ps], torch.float32)
        if any(m > 0 for m in min_ps) else None,
        kp_rows=None if len(kp) == len(params) else to_device(torch.tensor(kp, dtype=torch.int64), device),
        top_k=column(kp_ks, torch.int64) if any(kp_ks) else None,
        top_p=column(kp_ps, torch.float32) if any(p < 1.0 for p in kp_ps) else None,
        num_candidates=_initial_candidates(kp_ks, kp_ps, vocab_size),
        needs_row_total=_nucleus_only(kp_ks, kp_ps),
    )


def _max_logprobs(rows: Sequence[SamplingRow]) -> int | None:
    requested = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    return max(requested) if requested else None


@dataclass
class SamplingMetadata:
    """Per-step tensors derived from the `SamplingRow`s (build with `SamplingMetadata.build`)."""

    batch_size: int
    vocab_size: int
    greedy_rows: torch.Tensor | None  # [G] int64 batch positions of greedy rows, only in mixed batches
    random: _RandomMetadata | None  # None when every row is greedy
    banned_index: torch.Tensor | None  # flat (row * vocab + token) indices forced to -inf
    bias_index: torch.Tensor | None  # flat indices of the rows' logit_bias entries (distinct)
    bias: torch.Tensor | None  # [len(bias_index)] float32, added there
    penalties: _PenaltyMetadata | None
    max_num_logprobs: int | None  # K for top logprobs; None when no row asked for logprobs
    # Grammar-constrained rows (structured output): their batch positions and packed allowed-token
    # bitmasks ([G, ceil(V / 32)] int32, bit j of word w allows token 32 * w + j).
    mask_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return self.random is None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str = "cpu",
              mask_rows: np.ndarray | None = None, token_bitmask: np.ndarray | None = None) -> SamplingMetadata:
        """Tensors for one step, on `device` (the logits' device). O(rows + tokens) Python work.
        `mask_rows` / `token_bitmask`: the rows with a grammar and their packed allowed tokens."""
        device = torch.device(device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        banned = [(i, r.banned_token_ids) for i, r in enumerate(rows) if len(r.banned_token_ids)]
        bias_index, bias = _build_bias(rows, vocab_size)
        return cls(
            batch_size=len(rows),
            vocab_size=vocab_size,
            greedy_rows=to_device(torch.tensor(greedy, dtype=torch.int64), device) if greedy and random else None,
            random=_build_random(rows, random, len(rows), vocab_size, device) if random else None,
            banned_index=to_device(_flat_token_index(banned, vocab_size), device) if banned else None,
            bias_index=None if bias_index is None else to_device(bias_index, device),
            bias=None if bias is None else to_device(bias, device),
            penalties=_build_penalties(rows, vocab_size, device),
            max_num_logprobs=_max_logprobs(rows),
            mask_rows=None if mask_rows is None else to_device(torch.from_numpy(mask_rows), device),
            token_bitmask=None if token_bitmask is None else to_device(torch.from_numpy(token_bitmask), device),
        )


# ----------------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------------


class _Workspace:
    """Reusable scratch buffers (fresh multi-MB CPU allocations cost more than the math on them)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def _apply_penalties_(flat: torch.Tensor, meta: _PenaltyMetadata) -> None:
    """vLLM's penalties on the flattened logits, touching only tokens that occurred."""
    if meta.seen_index is not None and meta.repetition is not None:
        vals = flat[meta.seen_index]
        pen = meta.repetition
        flat[meta.seen_index] = torch.where(vals > 0, vals / pen, vals * pen)
    if meta.output_index is not None and meta.output_counts is not None:
        vals = flat[meta.output_index]
        vals = vals - meta.frequency * meta.output_counts
        vals = vals - meta.presence
        flat[meta.output_index] = vals


def _kth(vals: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Value of the k-th best candidate per row (k >= 1), -inf where k == 0."""
    picked = vals.gather(1, (k.clamp(1, vals.shape[1]) - 1))
    return torch.where(k > 0, picked, -math.inf)


def _nucleus_threshold(vals: torch.Tensor, kept_floor: torch.Tensor, top_p: torch.Tensor,
                       row_total: torch.Tensor | None, has_k: torch.Tensor | None) -> torch.Tensor:
    """Top-p threshold on sorted candidates: keep j while the mass before it is < top_p * total."""
    cum = torch.sub(vals, vals[:, :1]).exp_()
    if has_k is not None:
        cum.mul_(vals >= kept_floor)
    cum.cumsum_(dim=1)
    total = cum[:, -1:]
    if row_total is not None:
        total = row_total if has_k is None else torch.where(has_k, total, row_total)
    count = (cum < top_p * total).sum(dim=1, keepdim=True) + 1
    picked = vals.gather(1, count.clamp(max=vals.shape[1]) - 1)
    return torch.where(top_p < 1.0, picked, -math.inf)


def _thresholds_from_sorted(
    vals: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    row_total: torch.Tensor | None, complete: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(threshold, covered, exact) per row from descending candidates.

    covered: nothing outside the candidates survives; exact: the threshold is final (a top-p row is
    exact once every token its computation needs -- the top-k set, or the nucleus -- is a candidate).
    """
    threshold = torch.full_like(vals[:, :1], -math.inf) if top_k is None else _kth(vals, top_k)
    covered = exact = torch.ones_like(threshold, dtype=torch.bool)
    if top_p is not None:
        has_k = None if top_k is None else top_k > 0
        nucleus = _nucleus_threshold(vals, threshold, top_p, row_total, has_k)
        if not complete:
            needed = nucleus if has_k is None else torch.where(has_k, threshold, nucleus)
            exact = (top_p >= 1.0) | (vals[:, -1:] < needed)
        threshold = torch.maximum(threshold, nucleus)
    if not complete:
        covered = vals[:, -1:] < threshold
    return threshold, covered, exact


def _candidates(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    if width >= scores.shape[1]:
        return torch.sort(scores, dim=1, descending=True)
    return torch.topk(scores, width, dim=1)


def _sorted_values(scores: torch.Tensor) -> torch.Tensor:
    """Each row sorted descending, values only (numpy's sort is ~10x faster than torch's on CPU)."""
    if scores.device.type == "cpu":
        flipped = np.negative(scores.numpy())
        flipped.sort(axis=1)
        return torch.from_numpy(np.negative(flipped, out=flipped))
    return torch.sort(scores, dim=1, descending=True).values


class Sampler:
    """Samples one token per logits row. Not re-entrant: it keeps scratch buffers between calls.

    `sync_free` (default: on any device but the CPU) never reads a device value back mid-sampling: it
    trades the candidate shortcut of top-p rows for a full sort, whose thresholds are exact as they are.
    The draws are the same either way.
    """

    def __init__(self, sync_free: bool | None = None) -> None:
        self._sync_free = sync_free
        self._ws = _Workspace()
        self._counter_cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        expected = (metadata.batch_size, metadata.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"expected logits of shape {list(expected)}, got {list(logits.shape)}")
        raw = logits.float() if logits.dtype != torch.float32 else logits
        work = self._processed(raw, metadata)
        token_ids = self._sample(work, metadata)
        return self._with_logprobs(raw, token_ids, metadata)

    def processed_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The logits after grammar masks, banned tokens, biases and penalties (before temperature), fresh."""
        raw = logits.float() if logits.dtype != torch.float32 else logits
        return self._processed(raw, metadata).clone()

    # -- logits processing ---------------------------------------------------------------------------

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._ws.get(name, shape, dtype, like.device)

    def _processed(self, raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Grammar masks, banned tokens, logit biases and penalties applied, in that order, to a private
        copy; `raw` itself is never modified."""
        if md.banned_index is None and md.bias_index is None and md.penalties is None and md.token_bitmask is None:
            return raw
        work = self._buffer("work", tuple(raw.shape), raw).copy_(raw)
        if md.token_bitmask is not None and md.mask_rows is not None:
            self._apply_token_bitmask_(work, md.mask_rows, md.token_bitmask)
        flat = work.view(-1)
        if md.banned_index is not None:
            flat.index_fill_(0, md.banned_index, -math.inf)
        if md.bias_index is not None and md.bias is not None:
            flat.index_add_(0, md.bias_index, md.bias)  # a banned token stays at -inf
        if md.penalties is not None:
            _apply_penalties_(flat, md.penalties)
        return work

    def _apply_token_bitmask_(self, work: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens of the grammar rows to -inf, as one vectorised add of 0 / -inf per token.

        On the CPU the packed words are unpacked by numpy (`unpackbits` reads the int32 words as
        little-endian bytes: bit j of word w is token 32 * w + j) and turned into 0 / -inf by a table
        lookup; an add is branch-free, where a masked fill is slow on the irregular masks grammars
        give (`benchmarks/grammar_backends.py`: faster than xgrammar's CPU kernel too). On a GPU the
        same unpacking is a broadcast shift and mask.
        """
        vocab_size = work.shape[1]
        if work.device.type == "cpu":
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
            penalty = torch.from_numpy(_MASK_PENALTY.take(bits))
        else:
            shifts = torch.arange(32, dtype=torch.int32, device=work.device)
            bits = torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts).bitwise_and_(1)
            penalty = torch.where(bits.view(bitmask.shape[0], -1)[:, :vocab_size] == 1, 0.0, -math.inf)
        if rows.numel() == work.shape[0]:
            work.add_(penalty)
        else:
            work.index_add_(0, rows, penalty)

    # -- token choice --------------------------------------------------------------------------------

    def _sample(self, work: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        rand = md.random
        if rand is None:
            return _argmax_rows(work)
        random_tokens = self._sample_random(self._scaled(work, rand), rand)
        if md.greedy_rows is None or rand.rows is None:
            return random_tokens
        greedy = self._buffer("greedy", (md.greedy_rows.numel(), work.shape[1]), work)
        torch.index_select(work, 0, md.greedy_rows, out=greedy)
        token_ids = torch.empty(md.batch_size, dtype=torch.int64, device=work.device)
        token_ids.index_copy_(0, md.greedy_rows, _argmax_rows(greedy))
        token_ids.index_copy_(0, rand.rows, random_tokens)
        return token_ids

    def _scaled(self, work: torch.Tensor, rand: _RandomMetadata) -> torch.Tensor:
        """Temperature-scaled logits of the random rows, in a scratch buffer."""
        rows = work.shape[0] if rand.rows is None else rand.rows.numel()
        scaled = self._buffer("scaled", (rows, work.shape[1]), work)
        if rand.rows is None:
            return torch.div(work, rand.temperature, out=scaled)
        torch.index_select(work, 0, rand.rows, out=scaled)
        return scaled.div_(rand.temperature)

    def _sample_random(self, scaled: torch.Tensor, rand: _RandomMetadata) -> torch.Tensor:
        threshold: torch.Tensor | None = None
        candidates: tuple[torch.Tensor, torch.Tensor] | None = None
        if rand.uses_top_k_top_p:
            threshold, candidates = self._top_k_top_p(scaled, rand)
        if rand.log_min_p is not None:
            row_max = candidates[0][:, :1] if candidates is not None else scaled.amax(dim=1, keepdim=True)
            min_p_floor = row_max + rand.log_min_p
            threshold = min_p_floor if threshold is None else torch.maximum(threshold, min_p_floor)
        if candidates is not None and threshold is not None:
            return self._race_candidates(*candidates, threshold, rand.keys)
        return self._race_full(scaled, threshold, rand.keys)

    def _top_k_top_p(self, scaled: torch.Tensor,
                     rand: _RandomMetadata) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Per-row thresholds ([R, 1]) and, when every row's kept set fits in them, the candidates."""
        sub = scaled
        if rand.kp_rows is not None:
            sub = self._buffer("kp", (rand.kp_rows.numel(), scaled.shape[1]), scaled)
            torch.index_select(scaled, 0, rand.kp_rows, out=sub)
        width = rand.num_candidates
        sync_free = self._sync_free if self._sync_free is not None else sub.device.type != "cpu"
        if sync_free and rand.top_p is not None:
            # Asking whether each nucleus fit in the candidates would read a device value back mid-step;
            # a full sort makes every threshold exact without asking.
            width = sub.shape[1]
        vals, idx = _candidates(sub, width)
        row_total = self._row_total(sub, vals[:, :1]) if rand.needs_row_total else None
        complete = width >= sub.shape[1]
        threshold, covered, exact = _thresholds_from_sorted(vals, rand.top_k, rand.top_p, row_total, complete)
        if complete or sync_free:
            # Exact by construction: a full sort, or top-k alone (whose threshold is the k-th candidate).
            # Only a full sort is known to cover every kept token without reading `covered` back.
            use_candidates = complete
        else:
            all_exact = bool(exact.all())
            if not all_exact:
                threshold = _widen_nucleus(sub, threshold, exact, rand, row_total)
            use_candidates = all_exact and bool(covered.all())
        if rand.kp_rows is not None:
            full = torch.full((scaled.shape[0], 1), -math.inf, device=scaled.device)
            return full.index_copy_(0, rand.kp_rows, threshold), None
        return threshold, ((vals, idx) if use_candidates else None)

    def _row_total(self, sub: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """sum(exp(x - max)) over the whole row: the top-p normaliser of rows without top-k."""
        tmp = self._buffer("noise", tuple(sub.shape), sub)
        return torch.sub(sub, row_max, out=tmp).exp_().sum(dim=1, keepdim=True)

    def _race_candidates(self, vals: torch.Tensor, idx: torch.Tensor, threshold: torch.Tensor,
                         keys: torch.Tensor) -> torch.Tensor:
        """Exponential race over the candidates; ties go to the lowest token id, as in `_race_full`."""
        weights = torch.where(vals >= threshold, torch.exp(vals - vals[:, :1]), 0.0)
        scores = weights / torch.log2(hash_uniforms(keys, idx))
        best = scores.amin(dim=1, keepdim=True)
        vocab_end = torch.iinfo(torch.int64).max
        return torch.where(scores == best, idx, vocab_end).amin(dim=1)

    def _race_full(self, scaled: torch.Tensor, threshold: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """argmax_v p_v / E_v written as argmin_v p_v / log2(U_v) (the constant 1/ln 2 cancels).

        Filtered tokens get weight exactly 0 (a float 0/1 mask multiply: cheaper than masked_fill).
        """
        shape = tuple(scaled.shape)
        keep = None if threshold is None else torch.ge(scaled, threshold, out=self._buffer("keep", shape, scaled))
        weights = scaled.sub_(scaled.amax(dim=1, keepdim=True)).exp_()
        if keep is not None:
            weights.mul_(keep)
        bits = self._buffer("bits", shape, scaled, torch.int32)
        tmp = self._buffer("bits_tmp", shape, scaled, torch.int32)
        noise = self._buffer("noise", shape, scaled)
        _uniforms_into(self._counters(shape[1], scaled.device), keys, bits, tmp, noise)
        return weights.div_(noise.log2_()).argmin(dim=1)

    def _counters(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        key = (vocab_size, device)
        counters = self._counter_cache.get(key)
        if counters is None:
            counters = _token_counters(torch.arange(vocab_size, device=device))
            self._counter_cache[key] = counters
        return counters

    # -- logprobs ------------------------------------------------------------------------------------

    def _with_logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Logprobs of the raw logits (before penalties, temperature and filters), as vLLM v1 returns."""
        if md.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        row_max = raw.amax(dim=1, keepdim=True)
        tmp = self._buffer("logprobs", tuple(raw.shape), raw)
        log_total = torch.sub(raw, row_max, out=tmp).exp_().sum(dim=1, keepdim=True).log_()
        chosen_raw = raw.gather(1, token_ids.unsqueeze(1))
        chosen = (chosen_raw - row_max) - log_total
        ranks = (raw > chosen_raw).sum(dim=1).add_(1)
        top_vals, top_ids = torch.topk(raw, md.max_num_logprobs, dim=1)
        top_logprobs = (top_vals - row_max) - log_total
        return SamplerOutput(token_ids, chosen.squeeze(1), top_ids, top_logprobs, ranks)


def _argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token; on CUDA spread over many programs (`triton_argmax`), where torch's arg-reduction
    of a vocabulary-wide row runs on one thread block."""
    if scores.is_cuda:
        from llmserve.sampling import triton_argmax  # imports triton: only where it runs

        return triton_argmax.argmax_rows(scores)
    return scores.argmax(dim=1)


def _select(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, rows)


def _widen_nucleus(sub: torch.Tensor, threshold: torch.Tensor, exact: torch.Tensor, rand: _RandomMetadata,
                   row_total: torch.Tensor | None) -> torch.Tensor:
    """Recompute the thresholds of the rows whose nucleus did not fit in the candidates, on a full sort."""
    rows = (~exact).squeeze(1).nonzero().squeeze(1)
    vals = _sorted_values(sub.index_select(0, rows))
    fixed, _, _ = _thresholds_from_sorted(vals, _select(rand.top_k, rows), _select(rand.top_p, rows),
                                          _select(row_total, rows), complete=True)
    return threshold.index_copy(0, rows, fixed)
