"""The platform in front of the engines: API-key authentication, per-key rate limits and token quotas,
scheduling priority by key tier, usage metering.

Each service is optional (`Platform` fields left None are off). The request path never waits on the
database: keys are looked up through a short-lived cache, a key's quota use is read at its first
request of a period and refreshed in the background after, usage records go to a buffer that a
background thread writes in batches, and rate limits are one in-process or Redis call per request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import TYPE_CHECKING, Literal, Protocol

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.outputs import RequestOutput
from llmserve.platform.keys import ApiKey, KeyCache, looks_like_key, static_api_key
from llmserve.platform.quota import QuotaHold, QuotaLedger, QuotaState
from llmserve.platform.ratelimit import Limits, RateLimiter, RateLimiterUnavailable, Reservation
from llmserve.platform.usage import PriceTable, UsageRecord, UsageRecorder, UsageStatus
from llmserve.server.errors import APIError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmserve.platform.batches import BatchStore
    from llmserve.platform.chat_completions import StoredCompletions
    from llmserve.platform.conversations import ConversationStore
    from llmserve.platform.responses import ResponseStore
    from llmserve.platform.safety import SafetyFilter, Verdict
    from llmserve.server.metrics import PlatformMetrics
    from llmserve.server.reasoning import ReasoningTokens
    from llmserve.store.db import Database

logger = logging.getLogger(__name__)

PROGRESS_EVERY_TOKENS = 16  # how often a running request's token count is journaled
PURGE_INTERVAL_SECONDS = 3600.0
MAX_PRIORITY = 2**63 - 1  # a request's priority is an int64 (protocol.Int64)

# Answered without a key even once keys exist: liveness probes learn nothing about models or load.
ALWAYS_PUBLIC_PATHS = frozenset({"/health"})
# The ASGI scope entry that makes a request made inside this process (a batch's, server/batch_runner.py) the
# request of the key it holds. Only code in the process can put it there: a server builds scopes from HTTP.
IN_PROCESS_KEY = "llmserve.in_process_key"


class BatchSignals(Protocol):
    """What the Batch API's routes tell the server's batch runner (server/batch_runner.py)."""

    def wake(self) -> None: ...

    def cancelled(self, batch_id: str) -> None: ...


@dataclass
class Platform:
    """The platform services a server runs with; any left None is off."""

    keys: KeyCache | None = None
    limiter: RateLimiter | None = None
    quotas: QuotaLedger | None = None
    usage: UsageRecorder | None = None
    conversations: ConversationStore | None = None
    responses: ResponseStore | None = None  # the Responses API's stored responses
    completions: StoredCompletions | None = None  # chat completions made with `store: true`
    batches: BatchStore | None = None  # the Batch API's files and batches
    batch_concurrency: int = 8  # how many of a batch's requests run at once
    batch_runner: BatchSignals | None = None  # set while the server runs (server/batch_runner.py)
    safety: SafetyFilter | None = None
    holdback_chars: int = 32
    prices: PriceTable = field(default_factory=PriceTable)
    database: Database | None = None
    conversation_retention: timedelta | None = None  # deleted conversations are purged after this
    response_retention: timedelta | None = None  # stored responses and completions are purged this long after made
    metrics: PlatformMetrics | None = None
    tier_priorities: dict[str, int] = field(default_factory=dict)  # the config's `tiers`: key tier -> priority
    # When the rate limiter's store (Redis) is unreachable: "open" admits without limits (they keep
    # tenants fair, they are not a security boundary), "closed" answers 503.
    rate_limit_failure_mode: Literal["open", "closed"] = "open"
    aborting: bool = False  # past the shutdown timeout: what still runs is aborted by the server
    # The Responses API's background responses running in this process, by id (server/responses_api.py): held
    # here, as asyncio holds tasks weakly; each task removes itself when it ends.
    background: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _settling: set[asyncio.Task] = field(default_factory=set)

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def check_limiter(self) -> None:
        """At start: say whether the rate limiter's store answers (serving goes on either way)."""
        if self.limiter is None:
            return
        try:
            await self.limiter.check()
        except Exception as exc:  # serve anyway: limits fail open until the store is back
            logger.warning("the rate limiter's store is unreachable (limits are not enforced until it is): %s", exc)

    async def purge_expired(self) -> None:
        """Now and every hour: hard-delete conversations deleted longer ago than their retention period, stored
        responses and chat completions older than theirs, and the Batch API's files past their expiry."""
        jobs: list[tuple[Callable[[], int], str]] = [
            (partial(store.purge, retention), what) for store, retention, what in (
                (self.conversations, self.conversation_retention, "deleted conversations"),
                (self.responses, self.response_retention, "stored responses"),
                (self.completions, self.response_retention, "stored chat completions"),
            ) if store is not None and retention is not None]
        if self.batches is not None:
            jobs.append((self.batches.files.purge_expired, "expired files"))
        if not jobs:
            return
        while True:
            for purge, what in jobs:
                try:
                    purged = await asyncio.to_thread(purge)
                    if purged:
                        logger.info("purged %d %s", purged, what)
                except Exception:
                    logger.exception("could not purge %s", what)
            await asyncio.sleep(PURGE_INTERVAL_SECONDS)

    async def aclose(self) -> None:
        """Stop the background responses still running, settle what is in flight, write every buffered usage
        record, close connections."""
        await self._stop_background()
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        if self.usage is not None:
            await asyncio.to_thread(self.usage.close)
        if self.limiter is not None:
            await self.limiter.close()
        if self.database is not None:
            self.database.dispose()

    async def _stop_background(self) -> None:
        """Cancel the background responses still running (their engine requests are aborted): each is then stored
        `failed`, as ended by the shutdown, unless it ended first."""
        tasks = list(self.background.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- safety ---------------------------------------------------------------------------------------
    def check_prompt(self, model: str, texts: Sequence[str], param: str) -> None:
        """The safety pre-filter over a request's new input (run on a worker thread): a blocked prompt
        is a 400 `content_filter`, before any engine work."""
        if self.safety is None:
            return
        for text in texts:
            verdict = self.safety.check_prompt(text)
            if verdict.blocked:
                if self.metrics is not None:
                    self.metrics.safety_blocks.labels(model, "prompt", verdict.rule or "plugin").inc()
                logger.warning("safety: blocked a prompt for %s (rule %s)", model, verdict.rule)
                raise APIError(400, "Your request was rejected by the content filter.", param=param,
                               code="content_filter")

    def count_blocked_outputs(self, model: str, response_id: str, verdicts: Iterable[Verdict]) -> None:
        """The safety post-filter's bookkeeping: each choice it stopped, counted and logged."""
        for verdict in verdicts:
            if self.metrics is not None:
                self.metrics.safety_blocks.labels(model, "output", verdict.rule or "plugin").inc()
            logger.warning("safety: stopped the output of %s (rule %s)", response_id, verdict.rule)

    # ---- scheduling priority ----------------------------------------------------------------------
    def priority_of(self, key: ApiKey | None, requested: int) -> int:
        """The priority a request runs at: its key's tier's (config `tiers`) plus its own `priority`, which
        may put it later (a positive number), never earlier; without a tier priority, its own."""
        base = self.tier_priorities.get(key.tier) if key is not None else None
        if base is None:
            return requested
        if requested < 0:
            raise APIError(400, f"'priority' must not be negative for a key of tier {key.tier!r}: the tier sets "
                           "how early its requests run, a request may only ask to run later.", param="priority")
        return min(base + requested, MAX_PRIORITY)

    # ---- rate limits ------------------------------------------------------------------------------
    async def admit(self, key: ApiKey | None, model: str, reserve_tokens: int) -> Admission:
        """Hold `reserve_tokens` of the key's quota, then take one request and them from its rate limits
        (429 when either is spent)."""
        hold = await self._hold_quota(key, model, reserve_tokens)
        try:
            admission = await self._acquire_limits(key, model, reserve_tokens)
        except BaseException:
            if hold is not None and self.quotas is not None:
                self.quotas.release(hold, None, 0)
            raise
        admission.quota_hold = hold
        return admission

    async def _acquire_limits(self, key: ApiKey | None, model: str, reserve_tokens: int) -> Admission:
        limits = Limits(key.rpm, key.tpm) if key is not None else Limits(None, None)
        if self.limiter is None or key is None or (limits.rpm is None and limits.tpm is None):
            return Admission(self, None, {})
        try:
            result = await self.limiter.acquire(key.id, limits, reserve_tokens)
        except RateLimiterUnavailable as exc:
            return self._admit_without_limiter(model, exc)
        headers = result.headers()
        if not result.allowed:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(model, result.kind or "tokens").inc()
            raise APIError(
                429, result.message or "Rate limit reached.", code="rate_limit_exceeded",
                type=result.kind or "tokens", headers=headers,
            )
        return Admission(self, result.reservation, headers)

    async def _hold_quota(self, key: ApiKey | None, model: str, reserve_tokens: int) -> QuotaHold | None:
        if self.quotas is None or key is None or key.token_quota is None:
            return None
        try:
            state, hold = await self.quotas.hold(key, reserve_tokens)
        except Exception as exc:  # its use unknown, the key cannot be let through
            logger.error("could not read the quota use of key %s: %s", key.id, exc)
            raise APIError(503, "Quota accounting is unavailable; retry later.", code="quota_unavailable",
                           headers={"Retry-After": "1"}) from None
        if hold is None and state is not None:
            if self.metrics is not None:
                self.metrics.rate_limited.labels(model, "quota").inc()
            raise _quota_exceeded(state)
        return hold

    def _admit_without_limiter(self, model: str, exc: RateLimiterUnavailable) -> Admission:
        """The limiter's store is down: admit (fail open) or refuse with a 503 (closed), counted in a
        metric; the limiter logs the outage once per state change, so nothing is logged per request."""
        closed = self.rate_limit_failure_mode == "closed"
        if self.metrics is not None:
            self.metrics.rate_limit_decisions_without_redis.labels(model, "rejected" if closed else "admitted").inc()
        if not closed:
            return Admission(self, None, {})
        retry_after = max(1, math.ceil(exc.retry_after_s or 0.0))
        raise APIError(503, "Rate limiting is unavailable; retry later.", code="rate_limiter_unavailable",
                       headers={"Retry-After": str(retry_after)})

    def settle_later(
        self, reservation: Reservation, used_tokens: int, then: Callable[[], None] | None = None, *,
        withdrawn: bool = False,
    ) -> None:
        """Return a reservation's unused tokens (and its request, `withdrawn`), then run `then`, without
        making the caller wait (it may be unwinding from a cancellation)."""
        task = asyncio.ensure_future(self._settle(reservation, used_tokens, then, withdrawn))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(
        self, reservation: Reservation, used_tokens: int, then: Callable[[], None] | None, withdrawn: bool
    ) -> None:
        try:
            if self.limiter is not None:
                await self.limiter.settle(reservation, used_tokens, withdrawn=withdrawn)
        except RateLimiterUnavailable:  # logged by the limiter once per outage; the reservation expires
            pass
        except Exception as exc:  # the reservation then simply expires with the window
            logger.warning("could not settle a rate-limit reservation: %s", exc)
        finally:
            if then is not None:
                then()


def _quota_exceeded(state: QuotaState) -> APIError:
    """OpenAI's answer to a spent quota: 429 `insufficient_quota`, retried once the period turns."""
    per = "in total" if state.period == "total" else f"per {state.period}"
    message = f"You exceeded your token quota of {state.quota} tokens {per}: {state.used} used"
    if state.used < state.quota:  # running requests hold the rest: retry once they end
        message += f", the other {state.quota - state.used} held by this key's running requests."
        retry_after = 1
    elif state.resets_at is None:
        message += "; it does not renew. Ask for a larger quota."
        retry_after = None
    else:
        message += f"; it renews at {state.resets_at.isoformat().replace('+00:00', 'Z')}."
        retry_after = max(1, math.ceil((state.resets_at - datetime.now(timezone.utc)).total_seconds()))
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return APIError(429, message, code="insufficient_quota", type="insufficient_quota", headers=headers)


@dataclass
class Admission:
    """A request let through the quota and rate limits: the headers to answer with, its rate-limit
    reservation and its hold on the key's quota."""

    platform: Platform
    reservation: Reservation | None
    headers: dict[str, str]
    quota_hold: QuotaHold | None = None

    def release(self) -> None:
        """The request never reached the engine: give its tokens back (the request still counts)."""
        if self.reservation is not None:
            self.platform.settle_later(self.reservation, 0)
            self.reservation = None
        self.settle_quota(None, 0)

    def withdraw(self) -> None:
        """The request was refused as invalid (a replica's 4xx behind the gateway; the server refuses
        such a request before admitting it): it counts against no limit, neither tokens nor request."""
        if self.reservation is not None:
            self.platform.settle_later(self.reservation, 0, withdrawn=True)
            self.reservation = None
        self.settle_quota(None, 0)

    def settle_quota(self, request_id: str | None, used_tokens: int) -> None:
        """The request ended: its hold on the quota becomes the tokens it used, metered as `request_id`."""
        if self.quota_hold is not None and self.platform.quotas is not None:
            self.platform.quotas.release(self.quota_hold, request_id, used_tokens)
        self.quota_hold = None


class Meter:
    """One request's usage: token counts kept from the outputs it streamed, written once at its end
    (completed, cut short by a disconnect, filtered or failed), settling its rate-limit reservation."""

    def __init__(
        self,
        platform: Platform | None,
        request_id: str,
        key: ApiKey | None,
        model: str,
        admission: Admission | None,
        prompt_tokens: int,
    ) -> None:
        self.platform = platform
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self.key = key
        self.model = model
        self.admission = admission
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._latest: dict[int, RequestOutput] = {}
        self._journaled_tokens = 0
        self._durable: Future[None] | None = None
        self.finished = False
        self.predicted = False  # the request gave a predicted output: its usage tells how much of it was taken
        self.reasoning: ReasoningTokens | None = None  # a reasoning model's chat reply: its reasoning is counted
        if self._usage is not None:
            self._usage.started(request_id, self._key_id, model, prompt_tokens, self._created_at)

    @property
    def _usage(self) -> UsageRecorder | None:
        return self.platform.usage if self.platform is not None else None

    @property
    def _key_id(self) -> str | None:
        return self.key.id if self.key is not None else None

    @property
    def _created_at(self) -> datetime:
        return datetime.fromtimestamp(self.started_wall, tz=timezone.utc)

    def observe(self, position: int, output: RequestOutput) -> None:
        self._latest[position] = output
        if self.first_token_at is None and any(c.token_ids for c in output.outputs):
            self.first_token_at = time.monotonic()
        self._journal_progress()

    def _journal_progress(self) -> None:
        """Journal the running token count every PROGRESS_EVERY_TOKENS tokens (a crash then loses less)."""
        usage = self._usage
        if usage is not None and usage.journal is not None:
            tokens = self.completion_tokens
            if tokens - self._journaled_tokens >= PROGRESS_EVERY_TOKENS:
                self._journaled_tokens = tokens
                usage.progress(self.request_id, tokens, self.cached_tokens, self.prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self._latest.values() for c in o.outputs)

    @property
    def cached_tokens(self) -> int:
        return sum(o.num_cached_tokens for o in self._latest.values())

    @property
    def reasoning_tokens(self) -> int:
        """Its reasoning tokens, over every choice (0 where the reply is not parsed for reasoning)."""
        if self.reasoning is None:
            return 0
        return sum(self.reasoning.count((position, c.index), c.token_ids)
                   for position, o in self._latest.items() for c in o.outputs)

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """Its predicted output's tokens the model took, and those it did not, over every choice."""
        choices = [c for o in self._latest.values() for c in o.outputs]
        return (sum(c.accepted_prediction_tokens for c in choices), sum(c.rejected_prediction_tokens for c in choices))

    def finish(self, status: str) -> None:
        """Record the usage (journaled at once) and settle the reservation; later calls do nothing."""
        if self.finished:
            return
        self.finished = True
        if self.platform is None:
            return
        if self.platform.aborting and status in (UsageStatus.ERROR, UsageStatus.DISCONNECTED):
            status = UsageStatus.ABORTED_BY_SERVER
        usage = self.platform.usage
        record = self._record(status)
        if usage is not None:
            self._durable = usage.journal_end(record)
        write = (lambda: usage.record(record)) if usage is not None else None
        used = self.prompt_tokens + self.completion_tokens
        if self.admission is not None:  # the quota's ledger counts the tokens until the record is stored
            self.admission.settle_quota(self.request_id, used)
        if self.admission is not None and self.admission.reservation is not None:
            # Settled before the record is written: once a request's usage is visible, so is its refund.
            self.platform.settle_later(self.admission.reservation, used, then=write)
            self.admission.reservation = None
        elif write is not None:
            write()

    async def finish_durably(self, status: str) -> None:
        """`finish`, then wait until the record is on disk in the usage journal (when there is one):
        called before a response's last byte, so that a response received in full is a response
        metered, even if the server dies right after."""
        self.finish(status)
        if self._durable is None:
            return
        try:
            await asyncio.wrap_future(self._durable)
        except OSError as exc:  # serving goes on; the record still reaches the database from memory
            logger.error("usage record %s is not on disk: %s", self.request_id, exc)

    def _record(self, status: str) -> UsageRecord:
        ended = time.monotonic()
        return UsageRecord(
            request_id=self.request_id,
            key_id=self._key_id,
            model=self.model,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            status=status,
            created_at=self._created_at,
            ttft_ms=None if self.first_token_at is None else (self.first_token_at - self.started) * 1000,
            latency_ms=(ended - self.started) * 1000,
        )


# ---- authentication -----------------------------------------------------------------------------


def _auth_error(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, type="invalid_request_error")


def _auth_unavailable(exc: Exception) -> APIError:
    # The key store is unreachable: nobody can be let in, so say so rather than fail with a 500.
    logger.error("API key lookup failed: %s", exc)
    return APIError(503, "Authentication is unavailable; retry later.", code="auth_unavailable",
                    headers={"Retry-After": "1"})


def _secret(scope: Scope) -> str | None:
    """The key a request gives: `Authorization: Bearer KEY` (OpenAI's clients), else `x-api-key: KEY` (Anthropic's);
    "" for a malformed one, None for none."""
    given = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
        if name == b"x-api-key":
            given = value.decode("latin-1").strip()
    return given


def _masked(secret: str) -> str:
    return secret[:8] + "***" + secret[-4:] if len(secret) > 16 else "***"


class AuthMiddleware:
    """Once keys exist, every HTTP request but those for `public_paths` needs a valid key (401
    otherwise), so a route added later is private unless made public on purpose; with no keys the
    server is open (local mode). `api_key` (`--api-key`, vLLM's) is one more secret, not stored, which
    closes the server by itself; `keys` may then be None (no platform). The key found is left in the
    request's state as `api_key` (None when open)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyCache | None,
        metrics: PlatformMetrics | None = None,
        public_paths: Collection[str] = ALWAYS_PUBLIC_PATHS,
        api_key: str | None = None,
    ) -> None:
        if keys is None and not api_key:
            raise ValueError("AuthMiddleware needs stored keys or an api_key.")
        self.app = app
        self.keys = keys
        self.metrics = metrics
        self.public_paths = frozenset(public_paths)
        self.api_key = api_key.encode() if api_key else None
        self.static_key = static_api_key(datetime.now(timezone.utc)) if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            await self.app(scope, receive, send)
            return
        if IN_PROCESS_KEY in scope:
            scope.setdefault("state", {})["api_key"] = scope[IN_PROCESS_KEY]
            await self.app(scope, receive, send)
            return
        try:
            key = await self._authenticate(scope)
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else _auth_unavailable(exc)
            if self.metrics is not None:
                self.metrics.auth_failures.labels(error.code or "invalid_api_key").inc()
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)

    async def _authenticate(self, scope: Scope) -> ApiKey | None:
        secret = _secret(scope)
        if self.api_key is not None and secret and hmac.compare_digest(secret.encode(), self.api_key):
            return self.static_key
        if self.api_key is None and self.keys is not None and not await self.keys.has_active_keys():
            return None
        if not secret:
            raise _auth_error(
                "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
                "(Authorization: Bearer YOUR_KEY), or in an x-api-key header.",
                "missing_api_key",
            )
        if not looks_like_key(secret) and self.api_key is None:
            raise _auth_error(f"Malformed API key provided: {_masked(secret)}.", "invalid_api_key")
        key = await self.keys.authenticate(secret) if self.keys is not None and looks_like_key(secret) else None
        if key is None:
            raise _auth_error(
                f"Incorrect API key provided: {_masked(secret)}. The key is unknown or was revoked.",
                "invalid_api_key",
            )
        return key


def public_paths(app: FastAPI, public_metrics: bool, public_openapi: bool) -> frozenset[str]:
    """The paths answered without a key once keys exist."""
    public = set(ALWAYS_PUBLIC_PATHS)
    if public_metrics:
        public.add("/metrics")
    if public_openapi:
        oauth2_redirect = app.swagger_ui_oauth2_redirect_url if app.docs_url else None
        public.update(path for path in (app.openapi_url, app.docs_url, app.redoc_url, oauth2_redirect) if path)
    return frozenset(public)


def platform_of(request: Request) -> Platform | None:
    """The platform of the app serving `request` (`llmserve serve`'s or `llmserve gateway`'s)."""
    return getattr(request.app.state, "platform", None)


def request_key(scope_state: object) -> ApiKey | None:
    """The API key the auth middleware found for this request (None in local mode or with auth off)."""
    return getattr(scope_state, "api_key", None)
