"""The platform `llmserve serve` and `llmserve gateway` run, built from their common options
(cli.add_platform_args): keys, usage, conversations and stored responses in the database, rate limits in process or in
Redis, safety rules, prices and aliases from the config. Torch-free, as the gateway is."""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from llmserve.platform.conversations import ConversationLimits
from llmserve.platform.ratelimit import InProcessRateLimiter, RateLimiter
from llmserve.platform.routing import ModelsConfig
from llmserve.server.gateway import Platform
from llmserve.server.streaming import ResumeLimits

if TYPE_CHECKING:
    from llmserve.platform.usage import UsageRecorder
    from llmserve.store.db import Database


def resume_limits(args: argparse.Namespace) -> ResumeLimits:
    """--stream-resume-*: the bounds of resumable streams' buffers (bad values end the command with why)."""
    try:
        return ResumeLimits(max_chars=args.stream_resume_max_chars, grace_seconds=args.stream_resume_grace_seconds)
    except ValueError as exc:
        raise SystemExit(f"llmserve {args.command}: {exc}") from None


def make_rate_limiter(redis_url: str | None, redis_timeout_ms: float = 100.0) -> RateLimiter:
    """Redis-backed when `redis_url` is given (replicas share limits), else in-process."""
    if redis_url:
        from llmserve.platform.ratelimit_redis import RedisRateLimiter

        return RedisRateLimiter(redis_url, timeout_s=redis_timeout_ms / 1000)
    return InProcessRateLimiter()


def build_platform(args: argparse.Namespace, config: ModelsConfig | None) -> Platform | None:
    """Keys, usage, conversations, stored responses and chat completions, the Batch API's files and batches in the
    database; rate limits in process or in Redis; safety rules."""
    if args.no_platform:
        return None
    from llmserve.platform.batches import BatchStore, FileStore
    from llmserve.platform.chat_completions import StoredCompletions
    from llmserve.platform.conversations import ConversationStore
    from llmserve.platform.keys import KeyCache, KeyStore
    from llmserve.platform.quota import QuotaLedger
    from llmserve.platform.responses import ResponseStore
    from llmserve.platform.safety import load_filter
    from llmserve.platform.usage import Price, PriceTable
    from llmserve.store.db import default_database_url, open_database

    database = open_database(args.database_url or default_database_url())
    key_store = KeyStore(database)
    safety_config = config.safety if config is not None else None
    spec = args.safety_filter or (safety_config.filter if safety_config is not None else None)
    rules = safety_config.rules() if safety_config is not None else None
    prices = PriceTable(
        {
            model: Price(p.input, p.cached_input, p.output)
            for model, p in (config.prices.items() if config is not None else ())
        }
    )
    usage = _usage_recorder(database, args.usage_journal, args.usage_journal_sync)
    return Platform(
        keys=KeyCache(key_store),
        limiter=make_rate_limiter(args.redis_url, args.redis_timeout_ms),
        quotas=QuotaLedger(database, usage),
        rate_limit_failure_mode=args.rate_limit_failure_mode,
        usage=usage,
        conversations=ConversationStore(database, conversation_limits(args)),
        responses=ResponseStore(database),
        completions=StoredCompletions(database),
        batches=BatchStore(database, FileStore(database, args.max_file_bytes)),
        batch_concurrency=args.batch_concurrency,
        safety=load_filter(spec, rules),
        holdback_chars=safety_config.holdback_chars if safety_config is not None else 32,
        prices=prices,
        tier_priorities={name: tier.priority for name, tier in (config.tiers.items() if config is not None else ())},
        database=database,
        conversation_retention=timedelta(days=args.conversation_retention_days),
        response_retention=timedelta(days=args.response_retention_days),
    )


def conversation_limits(args: argparse.Namespace) -> ConversationLimits:
    limits = ConversationLimits()
    return ConversationLimits(
        max_message_bytes=args.conversation_max_message_bytes or limits.max_message_bytes,
        max_messages_per_request=limits.max_messages_per_request,
        max_messages=args.conversation_max_messages or limits.max_messages,
    )


def _usage_recorder(database: Database, journal_dir: str | None, sync: str) -> UsageRecorder:
    """Usage metering through the local journal; what a crashed run left in it is written now."""
    from llmserve.platform.usage import UsageRecorder
    from llmserve.platform.usage_journal import UsageJournal, default_journal_dir

    directory = Path(journal_dir).expanduser() if journal_dir else default_journal_dir(database.url)
    recorder = UsageRecorder(database, journal=UsageJournal(directory, sync=sync))
    recorder.flush()
    return recorder


def configured_aliases(args: argparse.Namespace, config: ModelsConfig | None) -> dict[str, list[tuple[str, float]]]:
    """The config's aliases, then --alias (`llmserve serve`'s and `llmserve gateway`'s)."""
    from llmserve.platform.routing import parse_alias

    aliases: dict[str, list[tuple[str, float]]] = dict(config.alias_targets()) if config is not None else {}
    for value in args.alias:
        alias, targets = parse_alias(value)
        aliases[alias] = targets
    return aliases
