"""The HTTP stack's own cost per streamed chunk, with no engine behind it: an OpenAI-shaped
/v1/completions that streams one pre-built SSE chunk per open stream per tick (6 ms, like an engine
step), served by uvicorn either as a FastAPI app with a StreamingResponse (what `llmserve serve`
uses) or as a raw ASGI callable. Load it with `llmserve bench serve` and read the server process's
CPU time: that over the chunks sent is the floor under the API server's cost per token.

    python benchmarks/sse_floor.py --mode fastapi --port 8013 &
    llmserve bench serve --base-url http://127.0.0.1:8013 --model tiny --tokenizer DIR --prompt-format ids \
        --random-input-len-range 32:128 --random-output-len-range 64:128 --exact-output-len --num-prompts 512
    # CPU of the server: utime + stime in /proc/PID/stat, before and after
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn

TICK_S = 0.006
HEAD = 'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":'


class Ticker:
    """Wakes every waiting stream once per tick."""

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            waiters, self.waiters = self.waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def tick(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await waiter


def events(ticker: Ticker, num_tokens: int):
    async def generate():
        for _ in range(num_tokens):
            await ticker.tick()
            yield HEAD + json.dumps(" tok") + ',"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
        usage = {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1}
        yield f'data: {{"id":"cmpl-1","object":"text_completion","choices":[],"usage":{json.dumps(usage)}}}\n\n'
        yield "data: [DONE]\n\n"

    return generate()


def fastapi_app(ticker: Ticker):
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI(on_startup=[lambda: asyncio.get_running_loop().create_task(ticker.run())])

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(events(ticker, body["max_tokens"]), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "tiny"}]}

    return app


def raw_app(ticker: Ticker):
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                asyncio.get_running_loop().create_task(ticker.run())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        streaming = scope["path"] == "/v1/completions"
        content_type = b"text/event-stream" if streaming else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        if not streaming:
            await send({"type": "http.response.body", "body": b'{"data":[{"id":"tiny"}]}'})
            return
        async for event in events(ticker, json.loads(body)["max_tokens"]):
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["fastapi", "raw"], default="fastapi")
    ap.add_argument("--port", type=int, default=8013)
    args = ap.parse_args()
    ticker = Ticker()
    app = fastapi_app(ticker) if args.mode == "fastapi" else raw_app(ticker)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
