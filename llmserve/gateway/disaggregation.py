"""Prefill/decode disaggregation, the gateway's part (after vLLM's disaggregated proxy and llm-d's P/D
scheduler): a long prompt is computed on a prefill replica, and its KV cache pulled from there by the
decode replica that generates the answer, so the decode replicas' running streams are not stalled by
long prefills.

A pool NAME may have prefill replicas (`--prefill-pool NAME=URL,...`), a pool of their own named
`NAME/prefill`, health-checked and ejected as any other; the pool's own replicas are its decode
replicas. A chat or completion request of such a pool is disaggregated when its prompt is long and
not already cached where it goes (llm-d's rule: disaggregate only when the uncached prompt is long):
  1. the decode replica is chosen by the pool's routing as always;
  2. a prompt shorter than `min_prompt_chars` characters (the messages' text, or the prompt; token ids
     count `CHARS_PER_TOKEN_ID` each) is sent as it is (`skipped_short`), and so is one whose part that
     the decode replica is not remembered to hold (routing.py's `Route.cached`) is that short
     (`skipped_cached`);
  3. otherwise a healthy prefill replica, chosen by the pool's routing policy (by prefix cache and load), is
     sent the prefill call: the request with
     `kv_transfer_params: {"do_remote_decode": true}`, one token, not streamed; its answer's
     `kv_transfer_params` say where the prompt's KV waits (`remote_host` null: the host of the prefill
     replica's URL);
  4. the decode replica is sent the request with `kv_transfer_params: {"do_remote_prefill": true, ...}`
     (`transferred`), and its answer is relayed as any other, streamed or not.
A prefill call that fails (refused, timed out, not a 200, no usable `kv_transfer_params`) or finds no
healthy prefill replica costs the request nothing but time: the decode replica is sent the request as it
is (`prefill_failed`, `no_prefill_replica`). The prefill call's answer never reaches the client, nor
the platform's metering: only the decode replica's answer does.

Requests whose answer needs the prompt's logits (`prompt_logprobs`, a completion's `echo` with
`logprobs`) and completions of several prompts go as they are, uncounted: one transfer carries one
prompt's KV, and no logits."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from llmserve.gateway.client import REPLICA_ERRORS, ReplicaClient
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.pool import Pool, is_draining_answer
from llmserve.gateway.prefix_index import PromptKey
from llmserve.gateway.replica import Replica, ReplicaState
from llmserve.gateway.routing import NoReplicaAvailable, Route
from llmserve.server.streaming import PROGRESS_HEADER

logger = logging.getLogger(__name__)

KV_TRANSFER_PARAMS = "kv_transfer_params"
DISAGGREGATED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# One chunked-prefill step of a replica's default budget (--max-num-batched-tokens 1024) at about four
# characters a token (English text, BPE tokenizers). A shorter prompt costs the decode replica's
# running streams at most about one step's stall, about what fetching its KV from elsewhere costs;
# a longer one stalls them for several steps, which is what disaggregation takes off them.
DEFAULT_MIN_PROMPT_CHARS = 4096
CHARS_PER_TOKEN_ID = 4  # a prompt of token ids is weighed as text of about this many characters a token
# Long enough for a context window's worth of prompt on a busy replica; past it the decode replica
# computes the prompt itself, which is what the request would have cost without disaggregation.
DEFAULT_PREFILL_TIMEOUT_S = 30.0
# The prefill call goes without these: its answer is read here, as one plain JSON body.
_PREFILL_SKIPPED_HEADERS = frozenset({PROGRESS_HEADER, "accept-encoding", "content-type"})

TRANSFERRED = "transferred"
PREFILL_FAILED = "prefill_failed"
NO_PREFILL_REPLICA = "no_prefill_replica"
SKIPPED_SHORT = "skipped_short"
SKIPPED_CACHED = "skipped_cached"
OUTCOMES = (TRANSFERRED, PREFILL_FAILED, NO_PREFILL_REPLICA, SKIPPED_SHORT, SKIPPED_CACHED)


@dataclass(frozen=True)
class DisaggregationOptions:
    min_prompt_chars: int = DEFAULT_MIN_PROMPT_CHARS
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.min_prompt_chars < 0:
            raise ValueError(f"The P/D minimum prompt length must be >= 0, got {self.min_prompt_chars}.")
        if self.prefill_timeout_s <= 0:
            raise ValueError(f"The prefill timeout must be > 0, got {self.prefill_timeout_s}.")


def prefill_pool_name(pool: str) -> str:
    return f"{pool}/prefill"


def prompt_chars(prompt: PromptKey, length: int | None = None) -> int:
    """`length` elements of the prompt (all of it by default) in characters: a text's own, token ids
    weighed at `CHARS_PER_TOKEN_ID` each."""
    count = len(prompt) if length is None else length
    return count if isinstance(prompt, str) else count * CHARS_PER_TOKEN_ID


def transferable(path: str, payload: Mapping[str, Any]) -> bool:
    """Whether the request's shape allows a transfer: a chat or a completion of one prompt, whose answer
    needs no prompt logits."""
    if path not in DISAGGREGATED_PATHS or payload.get("prompt_logprobs") is not None:
        return False
    if path == "/v1/completions":
        if payload.get("echo") is True and payload.get("logprobs") is not None:
            return False
        prompt = payload.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and (
            len(prompt) == 1 or all(isinstance(token, int) for token in prompt)))
    return True


def prefill_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill call: the request computed up to its first token, not streamed, its KV kept."""
    body = {key: value for key, value in payload.items()
            if key not in ("stream_options", "best_of", "min_tokens", "max_completion_tokens")}
    body.update({KV_TRANSFER_PARAMS: {"do_remote_decode": True}, "max_tokens": 1, "stream": False, "n": 1})
    return body


def decode_body(payload: Mapping[str, Any], transfer: Mapping[str, Any]) -> dict[str, Any]:
    """The request as the client sent it, told where its prompt's KV waits."""
    return {**payload, KV_TRANSFER_PARAMS: {"do_remote_prefill": True, **transfer}}


def transfer_of(answer: bytes, prefill_url: str) -> dict[str, Any] | None:
    """Where the prefill replica's answer says the KV waits (`transfer_id`, `remote_host`, `remote_port`),
    or None when it does not say it usably."""
    try:
        params = json.loads(answer).get(KV_TRANSFER_PARAMS)
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(params, dict):
        return None
    transfer_id, host, port = params.get("transfer_id"), params.get("remote_host"), params.get("remote_port")
    if host is None:
        host = urlsplit(prefill_url).hostname  # the replica was not told its address: it is the URL's
    if not isinstance(transfer_id, str) or not transfer_id or not isinstance(host, str) or not host:
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    return {"transfer_id": transfer_id, "remote_host": host, "remote_port": port}


def _prefill_headers(headers: Mapping[str, str]) -> dict[str, str]:
    kept = {name: value for name, value in headers.items() if name.lower() not in _PREFILL_SKIPPED_HEADERS}
    return {**kept, "content-type": "application/json"}


class _PrefillFailed(Exception):
    """The prefill call gave no transfer; the request goes to its decode replica as it is."""


class Disaggregator:
    """Decides, per request, whether to disaggregate it, and makes the prefill call."""

    def __init__(
        self, prefill_pools: Mapping[str, Pool], client: ReplicaClient, metrics: GatewayMetrics,
        options: DisaggregationOptions | None = None,
    ) -> None:
        self.prefill_pools = dict(prefill_pools)  # decode pool's name -> its prefill replicas
        self.client = client
        self.metrics = metrics
        self.options = options or DisaggregationOptions()
        for pool in self.prefill_pools:
            for outcome in OUTCOMES:
                metrics.disaggregated.labels(pool, outcome)  # every outcome shows, at 0 until it happens

    def applies(self, pool: Pool, path: str, payload: Mapping[str, Any] | None) -> bool:
        """Whether the request is one P/D may take (its pool has prefill replicas, its shape allows it)."""
        return payload is not None and pool.name in self.prefill_pools and transferable(path, payload)

    async def decode_request(
        self, pool: Pool, path: str, payload: Mapping[str, Any], prompt: PromptKey, route: Route,
        headers: Mapping[str, str],
    ) -> bytes | None:
        """The body to send the decode replica `route` chose (the prefill call made), or None: send the
        request as it is."""
        outcome = self.skip_reason(prompt, route)
        if outcome is not None:
            self.metrics.disaggregated.labels(pool.name, outcome).inc()
            return None
        prefill_pool = self.prefill_pools[pool.name]
        try:
            replica = prefill_pool.choose(prompt)
        except NoReplicaAvailable:
            self.metrics.disaggregated.labels(pool.name, NO_PREFILL_REPLICA).inc()
            return None
        # The decode replica's load counts the request while it is prefilled elsewhere, so that a burst
        # of long prompts spreads over the decode replicas instead of all going to the one idle now.
        pool.policy.on_start(route.replica)
        try:
            transfer = await self._prefill(pool, prefill_pool, replica, path, payload, headers)
        except _PrefillFailed as exc:
            logger.warning("gateway: prefill of a %s request on %s failed (%s); it is decoded whole on %s",
                           pool.name, replica.url, exc, route.replica.url)
            self.metrics.disaggregated.labels(pool.name, PREFILL_FAILED).inc()
            return None
        finally:
            pool.policy.on_finish(route.replica)
        self.metrics.disaggregated.labels(pool.name, TRANSFERRED).inc()
        return json.dumps(decode_body(payload, transfer)).encode()

    def skip_reason(self, prompt: PromptKey, route: Route) -> str | None:
        """Why the request is not worth disaggregating, if it is not."""
        minimum = self.options.min_prompt_chars
        if prompt_chars(prompt) < minimum:
            return SKIPPED_SHORT
        if prompt_chars(prompt, len(prompt) - route.cached) < minimum:
            return SKIPPED_CACHED
        return None

    async def _prefill(
        self, pool: Pool, prefill_pool: Pool, replica: Replica, path: str, payload: Mapping[str, Any],
        headers: Mapping[str, str],
    ) -> dict[str, Any]:
        """The prefill call on `replica`: where the prompt's KV waits (raises `_PrefillFailed`)."""
        prefill_pool.policy.on_start(replica)
        self.metrics.requests.labels(prefill_pool.name, replica.url).inc()
        started = time.monotonic()
        try:
            status, answer = await self._post(replica, path, prefill_body(payload), _prefill_headers(headers))
        except TimeoutError as exc:  # before REPLICA_ERRORS, which holds OSError, its base
            # A slow prefill replica is not ejected for it: the health checks tell slow from hung.
            lost = "it was ejected" if replica.state is ReplicaState.EJECTED else "no answer in time"
            raise _PrefillFailed(lost) from exc
        except REPLICA_ERRORS as exc:
            prefill_pool.eject(replica, f"prefill call: {type(exc).__name__}: {exc}")
            raise _PrefillFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            prefill_pool.policy.on_finish(replica)
        if status == 503:
            if is_draining_answer(status, answer):
                prefill_pool.drain(replica)
            else:
                prefill_pool.eject(replica, "the prefill call was answered 503")
        if status != 200:
            raise _PrefillFailed(f"answered {status}: {answer[:200].decode(errors='replace')}")
        transfer = transfer_of(answer, replica.url)
        if transfer is None:
            raise _PrefillFailed(f"its answer has no usable `{KV_TRANSFER_PARAMS}`")
        self.metrics.prefill_seconds.labels(pool.name).observe(time.monotonic() - started)
        return transfer

    async def _post(
        self, replica: Replica, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """The call's status and whole answer, bounded by the prefill timeout and by the replica's ejection."""
        async with replica.waiting_for_answer(self.options.prefill_timeout_s):
            async with self.client.session.post(
                replica.url + path, data=json.dumps(body).encode(), headers=headers
            ) as response:
                return response.status, await response.read()
