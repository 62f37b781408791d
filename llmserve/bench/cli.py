"""The `llmserve bench` subcommand group: `bench serve` (load test) and `bench plot` (draw results).

Only argparse and the stdlib-only client module (for its default timeout) are imported here, so
building the top-level parser stays cheap and works without the benchmark's own dependencies
(httpx, tqdm, matplotlib); they load when a bench command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from llmserve.bench.client import DEFAULT_TIMEOUT_S

DATASETS: tuple[str, ...] = ("random", "random-mm", "shared-prefix", "multi-turn")
PROMPT_FORMATS: tuple[str, ...] = ("text", "ids")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    server.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    server.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapters the server serves: each request (each conversation) names one of them "
                        "at random instead of --model, as vLLM's benchmark does")
    server.add_argument("--tokenizer", default=None,
                        help="tokenizer directory for exact prompt lengths and token counts "
                             "(default: the server's /tokenize, else approximate by words)")
    server.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request timeout, seconds")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", default="random", choices=DATASETS)
    data.add_argument("--num-prompts", type=int, default=100,
                      help="requests per rate (multi-turn: conversations per rate)")
    data.add_argument("--prompt-format", default="text", choices=PROMPT_FORMATS,
                      help="ids: send token-id prompts to /v1/completions (exact lengths)")
    data.add_argument("--random-input-len-range", default="32:512", help="LOW:HIGH prompt tokens (random)")
    data.add_argument("--random-output-len-range", default="16:512", help="LOW:HIGH output tokens (random)")
    data.add_argument("--images-per-request", type=int, default=1,
                      help="random-mm: random images (PNG data: URLs, each request's its own) before each prompt; "
                      "chat endpoint only")
    data.add_argument("--image-size", default="336x336", help="random-mm: WIDTHxHEIGHT of the images")
    data.add_argument("--shared-prefix-len", type=int, default=1000, help="shared system prompt tokens")
    data.add_argument("--question-len", type=int, default=50, help="per-request question tokens (shared-prefix)")
    data.add_argument("--output-len", type=int, default=64, help="output tokens (shared-prefix)")
    data.add_argument("--num-turns", type=int, default=5, help="turns per conversation (multi-turn)")
    data.add_argument("--turn-input-len", type=int, default=50, help="tokens of each user turn (multi-turn)")
    data.add_argument("--turn-output-len", default="32",
                      help="output tokens per turn, N or LOW:HIGH drawn per turn (multi-turn)")
    data.add_argument("--system-prompt-len", type=int, default=0,
                      help="tokens of a system prompt shared by every conversation (multi-turn)")
    data.add_argument("--first-turn-context-len", default="0",
                      help="tokens of a context (a document) of its own before each conversation's first user "
                           "message, N or LOW:HIGH drawn per conversation (multi-turn; vLLM's multi-turn "
                           "benchmark opens with ~1,000)")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests (multi-turn: conversations) per second, inf = all at once; "
                           "a comma list (1,2,4,inf) sweeps several rates")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the inter-arrival times (1.0 = Poisson, < 1 burstier)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="cap on requests (multi-turn: conversations) in flight")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=0, help="short unmeasured requests sent first")

    req = parser.add_argument_group("request")
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--exact-output-len", action="store_true",
                     help="also send min_tokens = max_tokens, for servers that support it")
    req.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    out = parser.add_argument_group("output")
    out.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2e)")
    out.add_argument("--result-json", default=None, help="write the results to this JSON file")
    out.add_argument("--save-detailed", action="store_true", help="include every request in the result JSON")
    out.add_argument("--label", default=None, help="name of this run in the JSON and plots (default: model)")
    out.add_argument("--plot", default=None, help="draw latency and goodput against request rate to this PNG")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="result JSON files from `llmserve bench serve --result-json`")
    parser.add_argument("--labels", default=None, help="comma-separated legend names (default: each file's label)")
    parser.add_argument("-o", "--output", default="bench.png", help="PNG to write")


def _bench_serve(args: argparse.Namespace) -> int:
    from llmserve.bench.serve import cmd_bench_serve

    return cmd_bench_serve(args)


def _bench_plot(args: argparse.Namespace) -> int:
    from llmserve.bench.plot import cmd_bench_plot

    return cmd_bench_plot(args)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench serve` and `bench plot` under the top-level command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve_parser = bench_sub.add_parser(
        "serve", help="load-test a server: latency, throughput and goodput per request rate",
        description="Load-test any OpenAI-compatible streaming server, as `vllm bench serve` does.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_args(serve_parser)
    serve_parser.set_defaults(func=_bench_serve)
    plot_parser = bench_sub.add_parser(
        "plot", help="draw latency and goodput against request rate from result JSONs",
        description="e.g. llmserve bench plot ours.json hf.json --labels ours,baseline -o out.png",
    )
    add_plot_args(plot_parser)
    plot_parser.set_defaults(func=_bench_plot)
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.bench.cli serve ...`: the bench group on its own (as used by tests)."""
    parser = argparse.ArgumentParser(prog="llmserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
