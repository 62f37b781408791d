"""`llmserve bench serve`: load-test any OpenAI-compatible streaming server.

For each request rate of a sweep the benchmark builds a fresh workload (a new seed per rate, so a
server's prefix cache cannot reuse a previous rate's prompts), schedules conversation starts on a
gamma / Poisson arrival process, streams every request and reports latency and throughput.
Conversations run concurrently; the turns of one conversation run one after the other, each
sending the whole history so far. --max-concurrency bounds the conversations in flight (for the
single-turn datasets: requests in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from llmserve.bench import datasets
from llmserve.bench.client import (
    DEFAULT_TIMEOUT_S,
    SamplingOptions,
    StreamClient,
    build_payload,
    discover_model,
    is_chat_endpoint,
    join_url,
    server_root,
    stream_request,
)
from llmserve.bench.datasets import Conversation, TokenSource
from llmserve.bench.metrics import RequestResult, arrival_offsets, parse_slo, summarize

# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def parse_rates(text: str) -> list[float]:
    """Parse a comma list of rates: "2,4,inf" -> [2.0, 4.0, inf]."""
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if rate <= 0:
            raise ValueError(f"request rates must be > 0, got {part}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate is empty")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str
    model: str
    dataset: str
    num_prompts: int
    rates: list[float]
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "text"
    slo: dict[str, float] = field(default_factory=dict)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    timeout: float = DEFAULT_TIMEOUT_S
    num_warmups: int = 0
    progress: bool = True
    dataset_args: dict[str, Any] = field(default_factory=dict)
    lora_modules: list[str] = field(default_factory=list)  # adapter names, one drawn per conversation

    @property
    def url(self) -> str:
        return join_url(self.base_url, self.endpoint)

    def model_of(self, conversation: int) -> str:
        """The model conversation number `conversation` names: one of the LoRA adapters, drawn by the seed, or
        the model."""
        if not self.lora_modules:
            return self.model
        return random.Random(f"{self.seed}:{conversation}").choice(self.lora_modules)


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------


def make_token_source(args: argparse.Namespace, client: httpx.Client, model: str) -> TokenSource:
    if args.tokenizer:
        from llmserve.tokenizer.tokenizer import Tokenizer

        return datasets.LocalTokenizerSource(Tokenizer.from_pretrained(args.tokenizer))
    server = datasets.probe_server_tokenizer(client, server_root(args.base_url) + "/tokenize", model)
    source = server if server is not None else datasets.WordSource()
    source.calibrate(random.Random(args.seed))
    return source


def dataset_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.dataset == "random":
        return {"input_len_range": args.random_input_len_range, "output_len_range": args.random_output_len_range}
    if args.dataset == "random-mm":
        return {"input_len_range": args.random_input_len_range, "output_len_range": args.random_output_len_range,
                "images_per_request": args.images_per_request, "image_size": args.image_size}
    if args.dataset == "shared-prefix":
        return {"shared_prefix_len": args.shared_prefix_len, "question_len": args.question_len,
                "output_len": args.output_len}
    return {"num_turns": args.num_turns, "turn_input_len": args.turn_input_len,
            "turn_output_len": args.turn_output_len, "system_prompt_len": args.system_prompt_len,
            "first_turn_context_len": args.first_turn_context_len}


def build_workload(config: BenchConfig, source: TokenSource, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    extra = config.dataset_args
    if config.dataset == "random":
        return datasets.random_dataset(
            source, config.num_prompts, datasets.parse_len_range(extra["input_len_range"]),
            datasets.parse_len_range(extra["output_len_range"]), config.prompt_format, rng,
        )
    if config.dataset == "random-mm":
        if not is_chat_endpoint(config.endpoint):
            raise ValueError("the random-mm dataset sends images in chat messages: use --endpoint /v1/chat/completions")
        conversations = datasets.random_dataset(
            source, config.num_prompts, datasets.parse_len_range(extra["input_len_range"]),
            datasets.parse_len_range(extra["output_len_range"]), config.prompt_format, rng,
        )
        return datasets.with_random_images(conversations, extra["images_per_request"],
                                           datasets.parse_image_size(extra["image_size"]), rng)
    if config.dataset == "shared-prefix":
        return datasets.shared_prefix_dataset(
            source, config.num_prompts, extra["shared_prefix_len"], extra["question_len"], extra["output_len"],
            config.prompt_format, rng,
        )
    return datasets.multi_turn_dataset(
        source, config.num_prompts, extra["num_turns"], extra["turn_input_len"],
        datasets.parse_len_range(str(extra["turn_output_len"])),
        config.prompt_format, rng,
        system_prompt_len=extra.get("system_prompt_len", 0),
        first_turn_context_len=datasets.parse_optional_len_range(str(extra.get("first_turn_context_len", "0"))),
    )


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar when wanted and installed; otherwise nothing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class _RunContext:
    config: BenchConfig
    client: StreamClient
    count_tokens: Callable[[str], int] | None
    progress: _Progress
    start: float = 0.0


def _turn_prompt(config: BenchConfig, conversation: Conversation, turn: int, replies: list[str]) -> Any:
    if is_chat_endpoint(config.endpoint):
        return datasets.chat_messages(conversation, turn, replies)
    return datasets.completion_prompt(conversation, turn, replies)


async def _send_turn(ctx: _RunContext, model: str, conversation: Conversation, turn: int,
                     replies: list[str], reply_tokens: list[int]) -> RequestResult:
    config = ctx.config
    spec = conversation.turns[turn]
    payload = build_payload(model, config.endpoint, _turn_prompt(config, conversation, turn, replies),
                            spec.output_len, config.sampling)
    sent_at = time.perf_counter()
    result = await stream_request(ctx.client, config.url, payload, ctx.count_tokens)
    result.start_time = sent_at - ctx.start
    result.turn = turn
    if not result.input_tokens:
        result.input_tokens = datasets.estimated_input_len(conversation, turn, reply_tokens)
    return result


async def _run_conversation(ctx: _RunContext, index: int, conversation: Conversation, offset: float,
                            semaphore: asyncio.Semaphore | None) -> list[RequestResult]:
    await asyncio.sleep(max(0.0, ctx.start + offset - time.perf_counter()))
    results: list[RequestResult] = []
    replies: list[str] = []
    reply_tokens: list[int] = []
    async with semaphore if semaphore is not None else contextlib.nullcontext():
        for turn in range(len(conversation.turns)):
            result = await _send_turn(ctx, ctx.config.model_of(index), conversation, turn, replies, reply_tokens)
            result.conversation = index
            results.append(result)
            ctx.progress.update()
            if not result.success:
                break
            replies.append(result.generated_text)
            reply_tokens.append(result.output_tokens)
    for turn in range(len(results), len(conversation.turns)):
        results.append(RequestResult(error="Skipped: an earlier turn of the conversation failed",
                                     conversation=index, turn=turn))
        ctx.progress.update()
    return results


def _http_client(config: BenchConfig) -> StreamClient:
    return StreamClient(timeout=config.timeout)


async def _warmup(config: BenchConfig, source: TokenSource) -> None:
    """Short unmeasured requests with prompts of their own (so they warm no measured prompt's cache)."""
    rng = random.Random(config.seed - 1)
    async with _http_client(config) as client:
        for _ in range(config.num_warmups):
            prompt = source.ids(16, rng) if config.prompt_format == "ids" else source.text(16, rng)[0]
            conversation = Conversation([datasets.Turn(prompt, 16, 8)])
            payload = build_payload(config.model, config.endpoint, _turn_prompt(config, conversation, 0, []),
                                    8, config.sampling)
            result = await stream_request(client, config.url, payload)
            if not result.success:
                print(f"warning: warmup request failed: {result.error}", file=sys.stderr)


async def run_once(config: BenchConfig, conversations: list[Conversation], rate: float, seed: int,
                   count_tokens: Callable[[str], int] | None) -> tuple[list[RequestResult], float]:
    """Run one workload at one rate; returns every request's result and the run's wall time."""
    offsets = arrival_offsets(len(conversations), rate, config.burstiness, seed)
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    total = sum(len(c.turns) for c in conversations)
    async with _http_client(config) as client:
        progress = _Progress(total, f"rate {rate_label(rate)}", config.progress)
        ctx = _RunContext(config, client, count_tokens, progress, time.perf_counter())
        try:
            per_conversation = await asyncio.gather(*(
                _run_conversation(ctx, i, conv, offsets[i], semaphore) for i, conv in enumerate(conversations)
            ))
        finally:
            progress.close()
        duration = time.perf_counter() - ctx.start
    return [r for results in per_conversation for r in results], duration


def run_sweep(config: BenchConfig, source: TokenSource) -> list[dict[str, Any]]:
    """One summary per request rate."""
    runs = []
    multi_turn = config.dataset == "multi-turn"
    if config.num_warmups > 0:
        asyncio.run(_warmup(config, source))
    for index, rate in enumerate(config.rates):
        seed = config.seed + index
        conversations = build_workload(config, source, seed)
        results, duration = asyncio.run(run_once(config, conversations, rate, seed, source.output_counter()))
        summary = {"request_rate": rate_json(rate), "burstiness": config.burstiness,
                   "max_concurrency": config.max_concurrency,
                   **summarize(results, duration, config.slo, multi_turn=multi_turn)}
        summary["_results"] = results
        runs.append(summary)
        print(format_run(summary, config), flush=True)
    return runs


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate_text(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def _line(name: str, value: Any) -> str:
    return f"{name:<40}{value}"


def format_run(summary: dict[str, Any], config: BenchConfig) -> str:
    rate = _rate_text(summary["request_rate"])
    lines = [f"{f' Serving Benchmark Result (rate {rate} req/s) ':=^60}",
             _line("Completed requests:", summary["completed"]),
             _line("Failed requests:", summary["failed"])]
    if summary["failed"]:
        lines.append(_line("  429 / 503 / other HTTP:", f"{summary['rate_limited_429']} / "
                           f"{summary['unavailable_503']} / {summary['http_errors']}"))
        lines.append(_line("  client-side errors:", summary["client_errors"]))
        lines += [f"  e.g. {sample[:200]}" for sample in summary["error_samples"]]
    lines += [
        _line("Benchmark duration (s):", _fmt(summary["duration_s"])),
        _line("Total input tokens:", summary["total_input_tokens"]),
        _line("Total output tokens:", summary["total_output_tokens"]),
        _line("Request throughput (req/s):", _fmt(summary["request_throughput"])),
        _line("Output token throughput (tok/s):", _fmt(summary["output_throughput"])),
        _line("Total token throughput (tok/s):", _fmt(summary["total_token_throughput"])),
        _line("Mean concurrency:", _fmt(summary["mean_concurrency"])),
    ]
    goodput = summary.get("goodput")
    if goodput:
        lines.append(_line("Goodput (req/s):", _fmt(goodput["per_s"])))
        lines.append(_line("Requests meeting SLO (%):", _fmt(goodput["percent"], 1)))
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        stats = summary[key]
        lines.append(f"{f' {title} ':-^60}")
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(_line(f"{stat.capitalize() if stat == 'mean' else stat.upper()} (ms):", _fmt(stats[stat])))
    for turn, stats in (summary.get("per_turn_ttft_ms") or {}).items():
        if turn == "0":
            lines.append(f"{' TTFT by turn (ms): mean / p50 / p99 ':-^60}")
        lines.append(_line(f"turn {turn}:", f"{_fmt(stats['mean'])} / {_fmt(stats['p50'])} / {_fmt(stats['p99'])}"))
    lines.append("=" * 60)
    return "\n".join(lines)


def format_sweep(runs: list[dict[str, Any]]) -> str:
    """One line per rate, for sweeps."""
    header = (f"{'rate':>6} {'ok':>6} {'fail':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'ITL p50':>8} {'E2E p50':>9} {'good %':>7}")
    rows = [header, "-" * len(header)]
    for run in runs:
        goodput = run.get("goodput")
        rows.append(
            f"{_rate_text(run['request_rate']):>6} {run['completed']:>6} {run['failed']:>5} {run['request_throughput']:>7.2f} "
            f"{run['output_throughput']:>10.1f} {_fmt(run['ttft_ms']['p50'], 1):>9} "
            f"{_fmt(run['ttft_ms']['p99'], 1):>9} {_fmt(run['tpot_ms']['p50'], 1):>9} "
            f"{_fmt(run['itl_ms']['p50'], 1):>8} {_fmt(run['e2e_ms']['p50'], 1):>9} "
            f"{_fmt(goodput['percent'] if goodput else None, 1):>7}"
        )
    return "\n".join(rows)


def result_document(config: BenchConfig, source: TokenSource, runs: list[dict[str, Any]], label: str,
                    detailed: bool) -> dict[str, Any]:
    clean_runs = []
    for run in runs:
        results = run["_results"]
        clean = {k: v for k, v in run.items() if k != "_results"}
        if detailed:
            clean["requests"] = [r.to_json() for r in results]
        clean_runs.append(clean)
    return {
        "label": label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "model": config.model,
        "lora_modules": config.lora_modules,
        "dataset": config.dataset,
        "dataset_args": config.dataset_args,
        "num_prompts": config.num_prompts,
        "prompt_format": config.prompt_format,
        "token_source": source.name,
        "seed": config.seed,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "exact_output_len": config.sampling.exact_output_len,
        "slo_ms": config.slo,
        "runs": clean_runs,
    }


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


def _config_from_args(args: argparse.Namespace, model: str) -> BenchConfig:
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if args.prompt_format == "ids" and is_chat_endpoint(args.endpoint):
        raise ValueError("--prompt-format ids only works with /v1/completions")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.timeout > 0:
        raise ValueError("--timeout must be > 0")
    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=model, dataset=args.dataset,
        num_prompts=args.num_prompts, rates=parse_rates(args.request_rate), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, prompt_format=args.prompt_format,
        slo=parse_slo(args.slo), timeout=args.timeout, num_warmups=args.num_warmups,
        progress=not args.no_progress, dataset_args=dataset_args(args), lora_modules=args.lora_modules or [],
        sampling=SamplingOptions(temperature=args.temperature, exact_output_len=args.exact_output_len,
                                 extra_body=extra_body),
    )


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark described by parsed CLI args; returns the result document."""
    with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
        model = args.model or discover_model(client, args.base_url)
        config = _config_from_args(args, model)
        source = make_token_source(args, client, model)
        print(f"benchmarking {model} at {config.url}: dataset {config.dataset}, {config.num_prompts} "
              f"{'conversations' if config.dataset == 'multi-turn' else 'requests'} per rate, "
              f"token counts from {source.name}", flush=True)
        runs = run_sweep(config, source)
    if len(runs) > 1:
        print(format_sweep(runs))
    document = result_document(config, source, runs, args.label or model, args.save_detailed)
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {path}")
    if args.plot:
        from llmserve.bench.plot import plot_documents

        plot_documents([document], [document["label"]], args.plot)
        print(f"plot written to {args.plot}")
    return document


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        run_benchmark(args)
    except ImportError as exc:
        print(f"error: a benchmark dependency is missing ({exc}); pip install matplotlib tqdm", file=sys.stderr)
        return 2
    except (httpx.HTTPError, ValueError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0
