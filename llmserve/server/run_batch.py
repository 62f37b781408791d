"""`llmserve run-batch` (vLLM's): a file of OpenAI batch requests answered offline, without a server. Each line
(`{"custom_id", "method": "POST", "url", "body"}`, `url` one of the Batch API's endpoints) goes through the same app
`llmserve serve` runs, in process, so it is answered exactly as that request sent to the server would be; the output
has a line per request, in input order, in OpenAI's batch output shape (`{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`), failed requests included. A file that is no batch is refused
whole, naming each bad line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from llmserve.config import EngineConfig, engine_config_kwargs
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.batches import BatchRequest, parse_requests, result_record
from llmserve.server.app import build_app
from llmserve.server.batch_runner import decoded, post_in_process, request_id_of
from llmserve.server.serve import parse_model_args, resolve_model


def run_batch(args: argparse.Namespace) -> int:
    content = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()
    requests, errors = parse_requests(content, None)
    if errors:
        for error in errors:
            print(f"{args.input}:{error['line']}: {error['message']}", file=sys.stderr)
        return 2
    [model] = parse_model_args([args.model] if args.model else None, args.served_model_name)
    config = EngineConfig(model=resolve_model(model.model), **{**engine_config_kwargs(args),
                                                                 "served_model_name": model.name})
    records = asyncio.run(_answer_all(config, model.name, model.aliases, requests, args.max_concurrency))
    output = b"".join(json.dumps(record, ensure_ascii=False).encode() + b"\n" for record in records)
    if args.output == "-":
        sys.stdout.buffer.write(output)
    else:
        Path(args.output).write_bytes(output)
    failed = sum(1 for record in records if record["response"]["status_code"] >= 300)
    print(f"{len(records)} requests, {failed} failed", file=sys.stderr)
    return 0


async def _answer_all(config: EngineConfig, name: str, aliases: list[str], requests: list[BatchRequest],
                      max_concurrency: int) -> list[dict[str, Any]]:
    engine = await asyncio.to_thread(AsyncLLM.from_config, config)
    app = build_app(engine, name, model_aliases=aliases, owns_engine=True)
    gate = asyncio.Semaphore(max_concurrency)

    async def answer(request: BatchRequest) -> dict[str, Any]:
        async with gate:
            status, _, body = await post_in_process(app, request.url, json.dumps(request.body).encode())
        answer = decoded(body)
        return result_record(request.custom_id, status, request_id_of(answer), answer)

    async with app.router.lifespan_context(app):  # the engine is shut down when it ends
        return await asyncio.gather(*(answer(request) for request in requests))
