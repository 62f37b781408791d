"""Pure-Python benchmark arithmetic: arrival processes, per-request outcomes and run summaries.

Nothing here does I/O, so every function is deterministic and unit-testable. Times are seconds
internally; summaries report latencies in milliseconds.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2e")
MAX_ERROR_SAMPLES = 3


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and the reported percentiles of durations given in seconds, as milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    stats: dict[str, float | None] = {"mean": mean(ms)}
    for q in PERCENTILES:
        stats[f"p{q:g}"] = percentile(ms, q)
    stats["count"] = len(ms)
    return stats


# ---------------------------------------------------------------------------------------------
# arrival process
# ---------------------------------------------------------------------------------------------


def inter_arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n gaps (seconds) between request arrivals: gamma(shape=burstiness) with mean 1/rate.

    burstiness 1.0 gives exponential gaps (a Poisson process); smaller values are burstier,
    larger ones more regular. An infinite rate sends everything at once (all gaps zero).
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times relative to the benchmark start: the first request at 0, then cumulative gaps."""
    offsets: list[float] = []
    now = 0.0
    for gap in inter_arrival_times(n, rate, burstiness, seed):
        offsets.append(now)
        now += gap
    return offsets


# ---------------------------------------------------------------------------------------------
# per-request outcome
# ---------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What one streamed request measured. Times are seconds relative to the request's send time."""

    success: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    start_time: float = 0.0
    conversation: int = 0
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.latency, self.ttft, self.output_tokens)

    def to_json(self, with_text: bool = False) -> dict[str, Any]:
        data = asdict(self)
        data["tpot"] = self.tpot
        if not with_text:
            data.pop("generated_text")
        return data


def time_per_output_token(latency: float, ttft: float | None, output_tokens: int) -> float | None:
    """Mean decode time per token after the first: (e2e - ttft) / (output_tokens - 1).

    Undefined (None) without a first token or with fewer than two output tokens.
    """
    if ttft is None or output_tokens < 2:
        return None
    return max(latency - ttft, 0.0) / (output_tokens - 1)


# ---------------------------------------------------------------------------------------------
# SLOs and goodput
# ---------------------------------------------------------------------------------------------


def parse_slo(text: str | None) -> dict[str, float]:
    """Parse "ttft=500,tpot=50" (milliseconds) into {"ttft": 500.0, "tpot": 50.0}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
        number = float(value)
        if number <= 0:
            raise ValueError(f"SLO {key} must be > 0 ms, got {value}")
        slo[key] = number
    return slo


def meets_slo(result: RequestResult, slo: dict[str, float]) -> bool:
    """A successful request meets the SLO when every bound it is given holds.

    A request with a single output token has no TPOT, so a TPOT bound does not apply to it.
    """
    if not result.success:
        return False
    measured_ms = {
        "ttft": None if result.ttft is None else result.ttft * 1000.0,
        "tpot": None if result.tpot is None else result.tpot * 1000.0,
        "e2e": result.latency * 1000.0,
    }
    for key, bound in slo.items():
        value = measured_ms[key]
        if value is None:
            if key == "ttft":
                return False
            continue
        if value > bound:
            return False
    return True


def count_good(results: Iterable[RequestResult], slo: dict[str, float]) -> int:
    return sum(1 for r in results if meets_slo(r, slo))


def goodput(results: Sequence[RequestResult], slo: dict[str, float], duration: float) -> dict[str, Any] | None:
    """Requests meeting every SLO: count, per second of benchmark, and percent of all requests."""
    if not slo:
        return None
    good = count_good(results, slo)
    return {
        "slo_ms": dict(slo),
        "good_requests": good,
        "per_s": good / duration if duration > 0 else 0.0,
        "percent": 100.0 * good / len(results) if results else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# run summary
# ---------------------------------------------------------------------------------------------


def failure_breakdown(results: Iterable[RequestResult]) -> dict[str, Any]:
    """Failed requests split by HTTP status (429 and 503 called out) and by client-side error kind."""
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    samples: list[str] = []
    for r in results:
        if r.success:
            continue
        if r.error and r.error not in samples and len(samples) < MAX_ERROR_SAMPLES:
            samples.append(r.error)
        if r.status is not None and r.status != 200:
            statuses[str(r.status)] += 1
        else:
            errors[(r.error or "unknown").split(":", 1)[0]] += 1
    return {
        "rate_limited_429": statuses.get("429", 0),
        "unavailable_503": statuses.get("503", 0),
        "http_errors": dict(sorted(statuses.items())),
        "client_errors": dict(sorted(errors.items())),
        "error_samples": samples,
    }


def per_turn_ttft(results: Iterable[RequestResult]) -> dict[str, dict[str, float | None]]:
    """TTFT distribution for each turn index of multi-turn conversations (successful requests only)."""
    by_turn: dict[int, list[float]] = {}
    for r in results:
        if r.success and r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    return {str(turn): distribution_ms(values) for turn, values in sorted(by_turn.items())}


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo: dict[str, float] | None = None,
    multi_turn: bool = False,
) -> dict[str, Any]:
    """The report for one run (one request rate)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        **failure_breakdown(results),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "mean_concurrency": per_s(sum(r.latency for r in ok)),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for t in (r.tpot for r in ok) if t is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution_ms([r.latency for r in ok]),
        "goodput": goodput(results, slo or {}, duration),
    }
    if multi_turn:
        summary["per_turn_ttft_ms"] = per_turn_ttft(results)
    return summary
