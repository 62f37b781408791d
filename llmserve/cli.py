"""The `llmserve` command line: make-model, generate, serve, gateway (and bench, keys in their modules)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from llmserve.config import add_engine_args, engine_config_kwargs
from llmserve.errors import LLMServeError
from llmserve.server.reasoning import REASONING_PARSERS
from llmserve.server.tool_calls import TOOL_PARSERS


def cmd_make_model(args: argparse.Namespace) -> int:
    from llmserve.model.builtin import (
        SIZES_WITHOUT_DEFAULT_WEIGHTS,
        build_config,
        checkpoint_bytes,
        make_model,
    )

    if args.arch == "llava":
        from llmserve.model.builtin_llava import make_llava

        print(f"wrote llava-{args.size} (seed {args.seed}) to {make_llava(args.dir, args.size, args.seed)}")
        return 0
    if args.arch == "qwen2_vl":
        from llmserve.model.builtin_qwen2_vl import make_qwen2_vl

        print(f"wrote qwen2_vl-{args.size} (seed {args.seed}) to {make_qwen2_vl(args.dir, args.size, args.seed)}")
        return 0
    with_weights = args.with_weights or (not args.no_weights and args.size not in SIZES_WITHOUT_DEFAULT_WEIGHTS)
    if with_weights and args.size in SIZES_WITHOUT_DEFAULT_WEIGHTS:
        size_gb = checkpoint_bytes(build_config(args.arch, args.size)) / 1e9
        print(f"warning: writing {size_gb:.1f} GB of random weights; this takes a while", file=sys.stderr)
    path = make_model(args.dir, arch=args.arch, size=args.size, seed=args.seed, with_weights=with_weights)
    what = "" if with_weights else " (config and tokenizer only: serve it with --load-format dummy)"
    print(f"wrote {args.arch}-{args.size} (seed {args.seed}) to {path}{what}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve import LLM, SamplingParams

    llm = LLM(args.model, **engine_config_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sample_seed, n=args.n,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for completion in outputs[0].outputs:
        print(completion.text)
    metrics = outputs[0].metrics
    tokens = sum(len(c.token_ids) for c in outputs[0].outputs)
    elapsed = (metrics.finished_time or 0) - metrics.arrival_time
    print(f"[{tokens} tokens in {elapsed:.2f}s, finish_reason={outputs[0].outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.server.serve import run_server

    return run_server(args)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from llmserve.server.run_batch import run_batch

    return run_batch(args)


def cmd_gateway(args: argparse.Namespace) -> int:
    from llmserve.gateway.serve import run_gateway

    return run_gateway(args)


def _add_gateway_parser(sub: argparse._SubParsersAction) -> None:
    gateway = sub.add_parser(
        "gateway", help="the platform (keys, limits, usage, conversations, safety) and routing in front of pools "
        "of `llmserve serve --no-platform` replicas; several gateways share Redis and the database",
        description="Route requests over pools of `llmserve serve --no-platform` replicas (one pool per model), "
        "with the platform of `llmserve serve` in front: API keys, RPM/TPM limits, usage metering, "
        "conversations, safety screening, aliases and canaries. Gateways run side by side when they share "
        "--redis-url and a PostgreSQL --database-url.",
    )
    gateway.add_argument(
        "--pool", action="append", default=[], metavar="NAME=URL[,URL...]",
        help="the replicas serving model NAME (started with --served-model-name NAME); repeatable",
    )
    gateway.add_argument("--policy", choices=["prefix", "least_load", "round_robin"], default="prefix")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed at start)")
    gateway.add_argument(
        "--first-byte-timeout", type=float, default=600.0, metavar="SECONDS",
        help="retry elsewhere when a replica sends nothing for this long (a non-streamed reply comes "
             "whole, so this bounds one generation); a replica the health checks eject is left at once",
    )
    gateway.add_argument("--stream-idle-timeout", type=float, default=60.0, metavar="SECONDS",
                         help="end a stream with an error event when its replica sends nothing for this long")
    gateway.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds the streams it relays get on SIGTERM; then each ends with an error event",
    )
    gateway.add_argument("--resolve-interval", type=float, default=5.0, metavar="SECONDS",
                         help="how often dns+http://name:port pool entries are resolved again")
    gateway.add_argument(
        "--prefill-pool", action="append", default=[], metavar="NAME=URL[,URL...]",
        help="prefill replicas of pool NAME (started with --kv-transfer, as NAME's own replicas, which then "
             "decode): long prompts are computed there and their KV pulled by the decode replica; repeatable",
    )
    gateway.add_argument(
        "--pd-min-prompt-chars", type=int, default=4096, metavar="N",
        help="disaggregate a request only when the part of its prompt (characters of the messages' text or "
             "the prompt) that its decode replica does not hold cached is at least N (default: about one "
             "prefill step of 1024 tokens)",
    )
    gateway.add_argument("--pd-prefill-timeout", type=float, default=30.0, metavar="SECONDS",
                         help="a prefill call not answered within this is given up: the decode replica "
                              "computes the prompt itself")
    add_platform_args(gateway, "`pools: {name: [url, ...]}`, and aliases, prices, safety rules")
    gateway.set_defaults(func=cmd_gateway)


def add_platform_args(parser: argparse.ArgumentParser, config_help: str) -> argparse._ArgumentGroup:
    """The platform's options, the same for `llmserve serve` and `llmserve gateway`."""
    platform = parser.add_argument_group("platform (keys, rate limits, usage, conversations, safety)")
    platform.add_argument("--config", default=None, help=f"YAML file: {config_help}")
    platform.add_argument(
        "--alias", action="append", default=[], metavar="ALIAS=MODEL[:WEIGHT,...]",
        help="another name for a model, or a weighted canary between models (e.g. chat=v1:90,v2:10)",
    )
    platform.add_argument(
        "--database-url", default=None,
        help="SQLAlchemy URL for keys, usage and conversations (default: SQLite in the data directory; "
        "postgresql+psycopg://... to share it between replicas or gateways)",
    )
    platform.add_argument(
        "--redis-url", default=None,
        help="share rate limits and resumable streams between replicas or gateways through Redis (redis://host:6379/0)"
    )
    platform.add_argument(
        "--redis-timeout-ms", type=float, default=100.0,
        help="a rate-limit call whose Redis reply takes longer fails; after 3 failures in a row Redis is "
        "left alone for 5 s",
    )
    platform.add_argument(
        "--rate-limit-failure-mode", choices=["open", "closed"], default="open",
        help="when Redis cannot be reached: admit requests without limits (open) or answer 503 (closed)",
    )
    platform.add_argument(
        "--no-platform", action="store_true",
        help="serve without keys, rate limits, usage metering or conversations (no database)",
    )
    platform.add_argument("--safety-filter", default=None, metavar="MODULE:NAME", help="a safety filter plugin")
    platform.add_argument(
        "--conversation-retention-days", type=float, default=30.0,
        help="deleted conversations are purged after this many days",
    )
    platform.add_argument(
        "--response-retention-days", type=float, default=30.0,
        help="stored Responses API responses and stored chat completions are purged this many days after "
             "they were made (OpenAI keeps 30)",
    )
    platform.add_argument(
        "--max-file-bytes", type=int, default=100 * 1024 * 1024,
        help="the largest file POST /v1/files takes (a batch's input), in bytes",
    )
    platform.add_argument(
        "--batch-concurrency", type=int, default=8,
        help="how many of a batch's requests (the Batch API's) run at once; the rest wait their turn",
    )
    platform.add_argument(
        "--usage-journal", default=None, metavar="DIR",
        help="directory of the local usage journal that keeps usage through a crash "
        "(default: next to the SQLite file, else in the data directory)",
    )
    platform.add_argument(
        "--usage-journal-sync", choices=("fsync", "write"), default="fsync",
        help="a response's last byte waits until its usage record is fsynced (fsync: survives a crashed "
        "machine) or written to the journal file (write: survives a killed server, not a power loss; the "
        "fsync follows off the response's path)",
    )
    platform.add_argument(
        "--conversation-max-message-bytes", type=int, default=None,
        help="a stored conversation message may have at most this many UTF-8 bytes (default 1 MiB; 413 beyond)",
    )
    platform.add_argument(
        "--conversation-max-messages", type=int, default=None,
        help="a conversation may hold at most this many messages, every branch counted (default 10000; 413 beyond)",
    )
    platform.add_argument(
        "--api-key", default=os.environ.get("LLMSERVE_API_KEY") or None, metavar="KEY",
        help="clients must send this key (Authorization: Bearer KEY), as vLLM's --api-key; not stored, unlimited, "
        "an admin's; keys made with `llmserve keys create` work too (default: $LLMSERVE_API_KEY)",
    )
    platform.add_argument(
        "--public-metrics", action="store_true", help="answer /metrics without an API key once keys exist"
    )
    platform.add_argument(
        "--public-openapi", action="store_true", help="answer /openapi.json without an API key once keys exist"
    )
    platform.add_argument(
        "--allowed-origins", action="append", default=[], metavar="ORIGIN[,ORIGIN...]",
        help="let browser pages from these origins call the API (CORS; '*' for any; default: same origin only)",
    )
    platform.add_argument(
        "--max-request-body-bytes", type=int, default=8 * 1024 * 1024, help="a larger request body gets a 413"
    )
    platform.add_argument(
        "--stream-resume-grace-seconds", type=float, default=30.0,
        help="a resumable stream (stream_options.resumable) nobody follows is aborted after this long; a "
        "finished one is forgotten this long after its end",
    )
    platform.add_argument(
        "--stream-resume-max-chars", type=int, default=1 << 20,
        help="a resumable stream's buffer keeps at most this many characters of its newest events",
    )
    return platform


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(serve, several_models=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: from --model)")
    serve.add_argument("--max-waiting-requests", type=int, default=1024, help="past this many queued: 503")
    serve.add_argument(
        "--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
        help="the tool-call format replies are parsed in for tool_choice 'auto' (default: the model family's, "
        "from its chat template or architecture)",
    )
    serve.add_argument(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
        help="split replies into reasoning_content (<think>...</think>) and content; structured output "
        "constrains what follows the reasoning",
    )
    serve.add_argument(
        "--allowed-media-domains", action="append", default=[], metavar="HOST[,HOST...]",
        help="the hosts whose http(s) image URLs the server fetches for a vision-language model (vLLM's; default: "
        "any; 'none': no URL, only data: URLs)",
    )
    serve.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="render a chat request's own chat_template (vLLM's flag; by default such a request is a 400: a template "
        "is code, run in a sandbox but at the requester's choice of cost)",
    )
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    serve.add_argument(
        "--slo-ttft-ms", type=float, default=None,
        help="time-to-first-token target: requests that cannot meet it at the current load get a 503",
    )
    serve.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="time-per-output-token target (counted in goodput)"
    )
    add_platform_args(serve, "models, aliases, prices, safety rules")
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM serving engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a random-weight checkpoint with a locally trained tokenizer")
    make.add_argument("dir")
    make.add_argument("--arch", default="llama", choices=["llama", "qwen3", "llava", "qwen2_vl"],
                      help="llava: the built-in llama of --size with a CLIP vision tower; qwen2_vl: with Qwen2-VL's "
                           "vision tower and M-RoPE (both tiny, small or medium)")
    make.add_argument(
        "--size", default="tiny", choices=["tiny", "small", "medium", "8b"],
        help="8b: Llama-3.1-8B's configuration (llama only), written without weights unless --with-weights",
    )
    make.add_argument("--seed", type=int, default=0)
    weights = make.add_mutually_exclusive_group()
    weights.add_argument("--no-weights", action="store_true", help="config and tokenizer only")
    weights.add_argument("--with-weights", action="store_true", help="write weights even for 8b (about 16 GB)")
    make.set_defaults(func=cmd_make_model)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    batch = sub.add_parser("run-batch", help="answer a file of OpenAI batch requests offline (vLLM's run-batch)")
    add_engine_args(batch)
    batch.add_argument("-i", "--input", required=True, help="JSON Lines of batch requests ('-': standard input)")
    batch.add_argument("-o", "--output", required=True, help="where the answers go ('-': standard output)")
    batch.add_argument("--served-model-name", default=None, help="the model name the requests use (default: from --model)")
    batch.add_argument("--max-concurrency", type=int, default=256, help="requests given to the engine at once")
    batch.set_defaults(func=cmd_run_batch)
    _add_serve_parser(sub)
    _add_gateway_parser(sub)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)  # `llmserve bench serve|plot`
    from llmserve.platform.keys_cli import add_keys_parser

    add_keys_parser(sub)  # `llmserve keys create|list|revoke`
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (LLMServeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
