"""Unit tests for the benchmark's pure-Python metrics."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from llmserve.bench.metrics import (
    RequestResult,
    arrival_offsets,
    count_good,
    distribution_ms,
    failure_breakdown,
    goodput,
    inter_arrival_times,
    meets_slo,
    parse_slo,
    per_turn_ttft,
    percentile,
    summarize,
    time_per_output_token,
)


def ok(ttft: float, latency: float, output_tokens: int, **kw: object) -> RequestResult:
    return RequestResult(success=True, status=200, ttft=ttft, latency=latency, output_tokens=output_tokens, **kw)


# -- percentiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.25, 100.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_ms_converts_seconds() -> None:
    stats = distribution_ms([0.1, 0.2, 0.3])
    assert stats["mean"] == pytest.approx(200.0)
    assert stats["p50"] == pytest.approx(200.0)
    assert stats["p99"] == pytest.approx(298.0)
    assert stats["count"] == 3
    assert distribution_ms([])["mean"] is None


# -- TPOT -------------------------------------------------------------------------------------


def test_tpot_excludes_first_token() -> None:
    # 1 s to the first token, then 9 more tokens over 0.9 s: 100 ms per token after the first.
    assert time_per_output_token(1.9, 1.0, 10) == pytest.approx(0.1)
    assert ok(1.0, 1.9, 10).tpot == pytest.approx(0.1)


def test_tpot_undefined_for_single_token_or_no_ttft() -> None:
    assert time_per_output_token(1.0, 1.0, 1) is None
    assert time_per_output_token(1.0, None, 5) is None


# -- SLOs and goodput -------------------------------------------------------------------------


def test_parse_slo() -> None:
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo(" e2e = 2000 ") == {"e2e": 2000.0}
    assert parse_slo(None) == {}
    for bad in ("ttft", "foo=1", "ttft=-1", "ttft=abc"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_bound() -> None:
    slo = {"ttft": 100.0, "tpot": 20.0}
    results = [
        ok(0.05, 0.05 + 9 * 0.010, 10),  # good
        ok(0.20, 0.20 + 9 * 0.010, 10),  # TTFT too slow
        ok(0.05, 0.05 + 9 * 0.030, 10),  # TPOT too slow
        ok(0.09, 0.09, 1),  # one token: no TPOT, TTFT ok -> good
        RequestResult(success=False, status=429, error="HTTP 429"),  # failed: never good
    ]
    assert [meets_slo(r, slo) for r in results] == [True, False, False, True, False]
    assert count_good(results, slo) == 2
    report = goodput(results, slo, duration=4.0)
    assert report is not None
    assert report["good_requests"] == 2
    assert report["per_s"] == pytest.approx(0.5)
    assert report["percent"] == pytest.approx(40.0)
    assert goodput(results, {}, 4.0) is None


def test_goodput_boundary_is_inclusive() -> None:
    assert meets_slo(ok(0.1, 0.1, 1), {"ttft": 100.0})
    assert not meets_slo(ok(0.1001, 0.1001, 1), {"ttft": 100.0})


# -- arrivals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_arrivals_have_mean_one_over_rate(burstiness: float) -> None:
    gaps = inter_arrival_times(20000, rate=4.0, burstiness=burstiness, seed=7)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.04)
    # gamma(shape k, mean m) has variance m^2 / k: burstier (smaller k) means more spread.
    assert statistics.pvariance(gaps) == pytest.approx(0.25**2 / burstiness, rel=0.12)
    assert all(g >= 0 for g in gaps)


def test_arrivals_are_deterministic_for_a_seed() -> None:
    assert inter_arrival_times(50, 2.0, 1.0, seed=3) == inter_arrival_times(50, 2.0, 1.0, seed=3)
    assert inter_arrival_times(50, 2.0, 1.0, seed=3) != inter_arrival_times(50, 2.0, 1.0, seed=4)


def test_poisson_gaps_are_exponential() -> None:
    gaps = inter_arrival_times(20000, rate=1.0, burstiness=1.0, seed=1)
    # For an exponential distribution, P(gap > mean) = 1/e.
    assert sum(g > 1.0 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.02)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert inter_arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_arrival_offsets_are_cumulative_from_zero() -> None:
    gaps = inter_arrival_times(4, 2.0, 1.0, seed=9)
    offsets = arrival_offsets(4, 2.0, 1.0, seed=9)
    assert offsets[0] == 0.0
    assert offsets == pytest.approx([0.0, gaps[0], gaps[0] + gaps[1], gaps[0] + gaps[1] + gaps[2]])


@pytest.mark.parametrize("args", [(3, 0.0, 1.0), (3, -1.0, 1.0), (3, 1.0, 0.0), (-1, 1.0, 1.0)])
def test_arrivals_reject_bad_arguments(args: tuple[int, float, float]) -> None:
    with pytest.raises(ValueError):
        inter_arrival_times(*args)


# -- summaries --------------------------------------------------------------------------------


def test_summarize_counts_throughput_and_failures() -> None:
    results = [
        ok(0.1, 1.0, 10, input_tokens=100, itl=[0.1] * 9),
        ok(0.3, 2.1, 10, input_tokens=50, itl=[0.2] * 9),
        RequestResult(success=False, status=429, error="HTTP 429: busy"),
        RequestResult(success=False, status=503, error="HTTP 503: down"),
        RequestResult(success=False, status=None, error="ConnectError: refused"),
    ]
    summary = summarize(results, duration=2.0, slo={"ttft": 200.0})
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (5, 2, 3)
    assert summary["rate_limited_429"] == 1 and summary["unavailable_503"] == 1
    assert summary["client_errors"] == {"ConnectError": 1}
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(10.0)
    assert summary["total_token_throughput"] == pytest.approx(85.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(150.0)
    assert summary["itl_ms"]["count"] == 18
    assert summary["e2e_ms"]["p50"] == pytest.approx(1550.0)
    assert summary["goodput"]["good_requests"] == 1
    assert summary["goodput"]["percent"] == pytest.approx(20.0)
    assert "per_turn_ttft_ms" not in summary


def test_failure_breakdown_groups_statuses() -> None:
    results = [RequestResult(status=429), RequestResult(status=429), RequestResult(status=500), ok(0.1, 0.2, 2)]
    breakdown = failure_breakdown(results)
    assert breakdown["http_errors"] == {"429": 2, "500": 1}
    assert breakdown["rate_limited_429"] == 2
    assert breakdown["error_samples"] == []  # none of these carried an error message
    failed = [RequestResult(error=f"E{i % 5}: x") for i in range(10)]
    assert failure_breakdown(failed)["error_samples"] == ["E0: x", "E1: x", "E2: x"]


def test_per_turn_ttft() -> None:
    results = [ok(0.1, 0.5, 4, turn=0), ok(0.3, 0.5, 4, turn=0), ok(0.05, 0.5, 4, turn=1)]
    table = per_turn_ttft(results)
    assert table["0"]["mean"] == pytest.approx(200.0)
    assert table["1"]["p50"] == pytest.approx(50.0)
    assert summarize(results, 1.0, multi_turn=True)["per_turn_ttft_ms"] == table
