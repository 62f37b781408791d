"""`llmserve bench plot`: latency and goodput against request rate for one or more result JSONs.

Each result JSON (written by `llmserve bench serve --result-json`) becomes one line per panel,
so runs of two servers can be compared in one picture. An infinite rate is drawn to the right of
the largest finite rate, on a tick labelled "inf".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

Point = tuple[float, float]


def load_document(path: str | Path) -> dict[str, Any]:
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not isinstance(document.get("runs"), list):
        raise ValueError(f"{path} is not a `llmserve bench serve` result JSON (no 'runs' list)")
    return document


def _rate(run: dict[str, Any]) -> float:
    value = run.get("request_rate")
    return math.inf if value in ("inf", None) else float(value)


def inf_position(documents: list[dict[str, Any]]) -> float:
    """Where to draw rate=inf: a step right of the largest finite rate (1.0 when every rate is inf)."""
    finite = [_rate(run) for doc in documents for run in doc["runs"] if not math.isinf(_rate(run))]
    return max(finite) * 1.5 if finite else 1.0


def series(document: dict[str, Any], metric: str, stat: str | None, inf_x: float) -> list[Point]:
    """(rate, value) points of one metric, sorted by rate; a missing value leaves its point out."""
    points: list[Point] = []
    for run in document["runs"]:
        value = run.get(metric)
        if stat is not None:
            value = value.get(stat) if isinstance(value, dict) else None
        if value is None:
            continue
        rate = _rate(run)
        points.append((inf_x if math.isinf(rate) else rate, float(value)))
    return sorted(points)


def goodput_series(document: dict[str, Any], inf_x: float) -> tuple[list[Point], bool]:
    """Goodput (req/s) points, or request throughput when the run had no SLO (second item False)."""
    if all(run.get("goodput") for run in document["runs"]):
        return series(document, "goodput", "per_s", inf_x), True
    return series(document, "request_throughput", None, inf_x), False


def _draw(ax: Any, points: list[Point], label: str, color: str, style: str = "-o") -> None:
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, style, label=label, color=color)


def _slo_text(slo: dict[str, float] | None) -> str:
    return ", ".join(f"{key} <= {value:g} ms" for key, value in (slo or {}).items())


def _rate_ticks(ax: Any, documents: list[dict[str, Any]], inf_x: float) -> None:
    rates = sorted({_rate(run) for doc in documents for run in doc["runs"]})
    ticks = [inf_x if math.isinf(r) else r for r in rates]
    ax.set_xticks(ticks, ["inf" if math.isinf(r) else f"{r:g}" for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.grid(True, alpha=0.3)


def plot_documents(documents: list[dict[str, Any]], labels: list[str], out: str | Path) -> Path:
    """Draw TTFT p50/p99, TPOT p50, goodput and output throughput against rate to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(labels) != len(documents):
        raise ValueError(f"{len(labels)} labels for {len(documents)} result files")
    inf_x = inf_position(documents)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, tpot_ax), (good_ax, tput_ax) = axes
    colors = [entry["color"] for entry in plt.rcParams["axes.prop_cycle"]]
    all_goodput = True
    for index, (doc, label) in enumerate(zip(documents, labels, strict=True)):
        color = colors[index % len(colors)]
        _draw(ttft_ax, series(doc, "ttft_ms", "p50", inf_x), f"{label} p50", color)
        _draw(ttft_ax, series(doc, "ttft_ms", "p99", inf_x), f"{label} p99", color, "--s")
        _draw(tpot_ax, series(doc, "tpot_ms", "p50", inf_x), f"{label} p50", color)
        points, is_goodput = goodput_series(doc, inf_x)
        all_goodput &= is_goodput
        _draw(good_ax, points, label, color)
        _draw(tput_ax, series(doc, "output_throughput", None, inf_x), label, color)
    slo = next((doc.get("slo_ms") for doc in documents if doc.get("slo_ms")), None)
    ttft_ax.set(title="Time to first token", ylabel="ms")
    tpot_ax.set(title="Time per output token (excl. first)", ylabel="ms")
    good_title = f"Goodput ({_slo_text(slo)})" if all_goodput else "Request throughput (no SLO given)"
    good_ax.set(title=good_title, ylabel="req/s")
    tput_ax.set(title="Output token throughput", ylabel="tokens/s")
    for ax in axes.flat:
        _rate_ticks(ax, documents, inf_x)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_bench_plot(args: argparse.Namespace) -> int:
    try:
        documents = [load_document(path) for path in args.results]
        labels = (args.labels.split(",") if args.labels
                  else [str(doc.get("label") or Path(p).stem) for doc, p in zip(documents, args.results, strict=True)])
        path = plot_documents(documents, labels, args.output)
    except ImportError as exc:
        print(f"error: plotting needs matplotlib (pip install matplotlib): {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"plot written to {path}")
    return 0
