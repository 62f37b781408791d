"""Runs the Batch API's batches (platform/batches.py) in a server that serves the API: `llmserve serve`, or
`llmserve gateway` in front of its replicas.

Each request of a batch goes through the server's own app, in process, as an HTTP request of the key that made the
batch: the same validation, routing, limits, safety screening and usage metering as any request. At most
`concurrency` of them run at once, so interactive traffic keeps its share of the engine, and they go later than
interactive requests under the priority scheduling policy (BATCH_PRIORITY). A request refused for
the moment (429 or 503 with a Retry-After: a rate limit, an overloaded engine, a model loading) waits and is sent
again; any other answer is its result, saved at once, so a batch taken over after a crash or restart runs only the
requests that have none.

One runner per process takes batches, each under a lease it renews every couple of seconds, and runs them side by
side: their requests take turns at the `concurrency` slots, so a small batch is not held up until a large one ends.
A cancel is seen at once when it was made through this server, else at the next renewal: the requests running are
stopped (their generation aborted), and what has results is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from starlette.types import ASGIApp, Message

from llmserve.platform.batches import (
    BatchRequest,
    BatchStore,
    ClaimedBatch,
    parse_requests,
    result_record,
    unanswered_record,
)
from llmserve.platform.keys import STATIC_KEY_ID, ApiKey, KeyCache, static_api_key
from llmserve.server.gateway import IN_PROCESS_KEY, MAX_PRIORITY, Platform
from llmserve.server.metrics import PlatformMetrics
from llmserve.store.schema import utcnow

logger = logging.getLogger(__name__)

RETRYABLE = (429, 503)
# Added to a batch request's own `priority` (where its endpoint takes one): under `--scheduling-policy priority` the
# engine runs interactive requests first (lower runs first), and takes KV blocks back from batch requests first.
BATCH_PRIORITY = 1 << 20
_PRIORITIZED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/moderations")
MAX_RETRY_WAIT_SECONDS = 30.0
Outcome = Literal["completed", "cancelled", "expired", "failed"]


class _KeyRevoked(Exception):
    pass


@dataclass
class _Run:
    """One batch being run: why it stopped, once it has."""

    batch: ClaimedBatch
    key: ApiKey | None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = "completed"  # None: the lease was lost (another server runs it now)

    def stop(self, outcome: Outcome | None) -> None:
        if not self.stopped.is_set():
            self.outcome = outcome
            self.stopped.set()


class BatchRunner:
    def __init__(self, app: ASGIApp, store: BatchStore, keys: KeyCache | None, concurrency: int,
                 metrics: PlatformMetrics | None = None, lease: timedelta = timedelta(seconds=30),
                 poll_seconds: float = 2.0) -> None:
        self.app = app
        self.store = store
        self.keys = keys
        self.metrics = metrics
        self.concurrency = concurrency
        self.lease = lease
        # How soon a batch made, or cancelled, through another server sharing the database is seen.
        self.poll_seconds = poll_seconds
        self.id = f"runner_{secrets.token_hex(8)}"
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)  # the requests in flight, all batches together
        self._running: dict[str, _Run] = {}

    def wake(self) -> None:
        """A batch was made here: look for it now rather than at the next poll."""
        self._wake.set()

    def cancelled(self, batch_id: str) -> None:
        """A batch was cancelled here: if it runs here, stop it now rather than at the next renewal."""
        run = self._running.get(batch_id)
        if run is not None:
            run.stop("cancelled")

    async def run(self) -> None:
        """Until cancelled (the server stops): take batches and run them, up to `concurrency` at once, their
        requests sharing the `concurrency` slots in turn (a small batch is not stuck behind a large one)."""
        batches: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                batch = await self._claim() if len(batches) < self.concurrency else None
                if batch is not None:
                    task = asyncio.create_task(self._run_taken(batch))
                    batches.add(task)
                    task.add_done_callback(lambda done: (batches.discard(done), self._wake.set()))
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
        finally:
            for task in batches:
                task.cancel()
            await asyncio.gather(*batches, return_exceptions=True)

    async def _claim(self) -> ClaimedBatch | None:
        try:
            return await asyncio.to_thread(self.store.claim, self.id, self.lease)
        except Exception:
            logger.exception("could not look for a batch to run")
            return None

    async def _run_taken(self, batch: ClaimedBatch) -> None:
        try:
            await self._run(batch)
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.to_thread(self.store.release, batch.id, self.id))
            raise
        except Exception:
            logger.exception("batch %s stopped on an error; it is taken up again once its lease runs out", batch.id)

    async def _run(self, batch: ClaimedBatch) -> None:
        content = await asyncio.to_thread(self.store.input_of, batch)
        requests, errors = await asyncio.to_thread(parse_requests, content or b"", batch.endpoint)
        if batch.status == "validating":
            if errors:
                await asyncio.to_thread(self.store.fail, batch.id, self.id, errors)
                if self.metrics is not None:
                    self.metrics.batches_ended.labels("failed").inc()
                logger.info("batch %s failed validation: %s", batch.id, errors[0]["message"])
                return
            await asyncio.to_thread(self.store.start, batch.id, self.id, len(requests))
        run = _Run(batch, None)
        try:
            run.key = await self._key(batch)
        except _KeyRevoked:
            run.stop("failed")
        if batch.status == "cancelling":
            run.stop("cancelled")
        elif utcnow() >= batch.expires_at:
            run.stop("expired")
        if not run.stopped.is_set():
            answered = await asyncio.to_thread(self.store.answered_lines, batch.id)
            self._running[batch.id] = run
            try:
                await self._run_requests(run, [request for request in requests if request.line not in answered])
            finally:
                del self._running[batch.id]
        if run.outcome is not None:
            await self._finish(run, requests)

    async def _key(self, batch: ClaimedBatch) -> ApiKey | None:
        """The key the batch runs as: the one that made it, while it is active."""
        if batch.key_id is None:
            return None
        if batch.key_id == STATIC_KEY_ID:
            return static_api_key(utcnow())
        key = await self.keys.get_active(batch.key_id) if self.keys is not None else None
        if key is None:
            raise _KeyRevoked
        return key

    async def _run_requests(self, run: _Run, pending: list[BatchRequest]) -> None:
        queue = iter(pending)
        saves: set[asyncio.Task[None]] = set()
        workers = [asyncio.create_task(self._work(run, queue, saves))
                   for _ in range(min(self.concurrency, len(pending)))]
        watcher = asyncio.create_task(self._watch(run))
        stopped = asyncio.create_task(run.stopped.wait())
        all_done = asyncio.gather(*workers)
        try:
            await asyncio.wait([all_done, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*workers, watcher, stopped):
                task.cancel()
            await asyncio.gather(*workers, watcher, stopped, return_exceptions=True)
            saved = await asyncio.gather(*saves, return_exceptions=True)
        # A worker's error counts unless the batch was stopped (its workers were cancelled); a save's always does.
        # Either way the batch is taken up again once its lease runs out. Read even if unused: it was set.
        worker_error = all_done.exception() if all_done.done() and not all_done.cancelled() else None
        errors = [*([worker_error] if worker_error and not run.stopped.is_set() else []),
                  *(failure for failure in saved if isinstance(failure, BaseException))]
        if errors:
            raise errors[0]

    async def _work(self, run: _Run, queue: Iterator[BatchRequest], saves: set[asyncio.Task[None]]) -> None:
        for request in queue:
            status, body = await self._answer(run, request)
            record = result_record(request.custom_id, status, request_id_of(body), body)
            if self.metrics is not None:
                self.metrics.batch_requests.labels("succeeded" if 200 <= status < 300 else "failed").inc()
            # Saved while the next request runs; a stop does not cancel it (it is an answer), the end waits for it.
            save = asyncio.create_task(asyncio.to_thread(
                self.store.save_result, run.batch.id, request.line, 200 <= status < 300, record))
            saves.add(save)

    async def _watch(self, run: _Run) -> None:
        """Renew the lease while the batch runs; stop it when it is cancelled, expires, its key is revoked, or the
        lease is lost."""
        while True:
            await asyncio.sleep(min(self.lease.total_seconds() / 3, self.poll_seconds))
            status = await asyncio.to_thread(self.store.renew, run.batch.id, self.id, self.lease)
            if status is None:
                run.stop(None)
            elif status == "cancelling":
                run.stop("cancelled")
            elif utcnow() >= run.batch.expires_at:
                run.stop("expired")
            else:
                try:
                    await self._key(run.batch)
                except _KeyRevoked:
                    run.stop("failed")

    async def _answer(self, run: _Run, request: BatchRequest) -> tuple[int, Any]:
        """The request's answer, sent again (after the wait asked for) while it is refused for the moment."""
        payload = json.dumps(_deferred(request.url, request.body)).encode()
        while True:
            async with self._slots:
                status, headers, body = await post_in_process(self.app, request.url, payload, run.key)
            wait = _retry_after(status, headers)
            if wait is None:
                return status, decoded(body)
            await asyncio.sleep(wait)

    async def _finish(self, run: _Run, requests: list[BatchRequest]) -> None:
        unanswered: list[dict[str, Any]] = []
        if run.outcome != "completed":
            answered = await asyncio.to_thread(self.store.answered_lines, run.batch.id)
            code, message = _UNANSWERED[run.outcome]
            unanswered = [unanswered_record(r.custom_id, code, message) for r in requests if r.line not in answered]
        await asyncio.to_thread(self.store.finish, run.batch.id, self.id, run.outcome, unanswered)
        ended = await asyncio.to_thread(self.store.status_of, run.batch.id)  # a late cancel makes it "cancelled"
        if self.metrics is not None and ended is not None:
            self.metrics.batches_ended.labels(ended).inc()
        logger.info("batch %s %s", run.batch.id, ended)


_UNANSWERED = {
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "failed": ("key_revoked", "The API key that made the batch was revoked before this request ran."),
}


def _deferred(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body with BATCH_PRIORITY added to its priority (one that is no integer is left to fail as sent)."""
    own = body.get("priority", 0)
    if endpoint not in _PRIORITIZED or type(own) is not int:
        return body
    return {**body, "priority": min(own + BATCH_PRIORITY, MAX_PRIORITY)}


def _retry_after(status: int, headers: dict[str, str]) -> float | None:
    """How long to wait before sending a refused request again; None for an answer to keep."""
    value = headers.get("retry-after")
    if status not in RETRYABLE or value is None:
        return None
    try:
        return min(max(float(value), 0.05), MAX_RETRY_WAIT_SECONDS)
    except ValueError:
        return None


def decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def request_id_of(body: Any) -> str:
    found = body.get("id") if isinstance(body, dict) else None
    return found if isinstance(found, str) else f"req_{secrets.token_hex(12)}"


async def post_in_process(app: ASGIApp, path: str, payload: bytes,
                          key: ApiKey | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST `payload` to `app` at `path`, in process, as `key`: the status, headers (names lowercase) and body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}, IN_PROCESS_KEY: key,
    }
    sent = False
    never = asyncio.Event()  # the caller never hangs up: a cancelled batch cancels the call itself
    status, headers, chunks = 500, {}, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = {name.decode().lower(): value.decode() for name, value in message.get("headers", ())}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, headers, b"".join(chunks)


def start_batch_runner(app: ASGIApp, platform: Platform | None) -> asyncio.Task[None] | None:
    """At a server's start: run its platform's batches (none without a platform or its Batch API)."""
    if platform is None or platform.batches is None:
        return None
    platform.batch_runner = BatchRunner(app, platform.batches, platform.keys, platform.batch_concurrency,
                                        platform.metrics)
    return asyncio.create_task(platform.batch_runner.run())


async def stop_batch_runner(task: asyncio.Task[None] | None) -> None:
    """At its stop, before it drains: the requests running are stopped, and resumed by the next start."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
