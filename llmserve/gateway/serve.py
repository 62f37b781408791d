"""`llmserve gateway`: the pools from --pool and --config (and their prefill replicas from --prefill-pool
and the config's `prefill_pools`), the platform from the same options as `llmserve serve`'s
(server/serve.py builds it), the app, and uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn
import yaml
from pydantic import ValidationError

from llmserve.gateway.app import ReplicaOptions, build_gateway_app
from llmserve.gateway.disaggregation import DisaggregationOptions
from llmserve.gateway.discovery import entry_host
from llmserve.gateway.pool import DNS_SCHEME
from llmserve.platform.routing import ModelsConfig
from llmserve.server.cors import parse_origins
from llmserve.server.graceful import ABORT_GRACE_S, GracefulServer
from llmserve.server.platform_options import build_platform, configured_aliases, resume_limits

# The config's keys that name replicas (the rest is the platform's, see `platform_config`).
POOL_KEYS = ("pools", "prefill_pools")


def parse_pools(values: list[str], config_path: str | None) -> dict[str, list[str]]:
    """`--pool NAME=URL[,URL...]` (repeatable) joined with the config's `pools: {name: [urls]}`. A URL
    is one replica (`http://10.0.0.5:8000`), or with `dns+` every address its host name resolves to,
    re-resolved as they change (`dns+http://llmserve-replica-headless:8000`)."""
    pools = _pool_entries("pools", "--pool", values, config_path)
    if not pools:
        raise ValueError("Give at least one pool: --pool NAME=URL[,URL...] or --config with `pools:`.")
    return pools


def parse_prefill_pools(values: list[str], config_path: str | None, pools: dict[str, list[str]]) -> dict[str, list[str]]:
    """`--prefill-pool NAME=URL[,URL...]` (repeatable) joined with the config's `prefill_pools: {name: [urls]}`:
    the prefill replicas of pool NAME (whose own replicas decode), URLs as in `parse_pools`."""
    prefill = _pool_entries("prefill_pools", "--prefill-pool", values, config_path)
    unknown = [name for name in prefill if name not in pools]
    if unknown:
        raise ValueError(f"prefill pool {unknown[0]!r} is not a pool: give its decode replicas with --pool "
                         f"{unknown[0]}=URL[,URL...].")
    return prefill


def _pool_entries(key: str, flag: str, values: list[str], config_path: str | None) -> dict[str, list[str]]:
    """The config's `key: {name: [urls]}` joined with the `flag NAME=URL[,URL...]` values, each URL checked."""
    pools: dict[str, list[str]] = {}
    if config_path:
        config = yaml.safe_load(Path(config_path).expanduser().read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a mapping (`pools: {{name: [url, ...]}}`, aliases, ...).")
        entries = config.get(key, {})  # the pools may all come from the flag
        if not isinstance(entries, dict):
            raise ValueError(f"{config_path}: expected `{key}: {{name: [url, ...]}}`.")
        for name, urls in entries.items():
            if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
                raise ValueError(f"{config_path}: {key} {name!r} must be a list of URLs.")
            pools.setdefault(str(name), []).extend(urls)
    for value in values:
        name, sep, urls = value.partition("=")
        listed = [url.strip() for url in urls.split(",") if url.strip()]
        if not sep or not name or not listed:
            raise ValueError(f"{flag} {value!r}: expected NAME=URL[,URL...].")
        pools.setdefault(name, []).extend(listed)
    for name, urls in pools.items():
        bad = [url for url in urls if not url.removeprefix(DNS_SCHEME).startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"pool {name!r}: {bad[0]!r} is not an http(s) URL (or dns+http(s)).")
        for url in urls:
            if url.startswith(DNS_SCHEME):
                entry_host(url)
    return pools


def platform_config(config_path: str | None) -> ModelsConfig | None:
    """The platform's part of the gateway's --config: what `llmserve serve`'s --config holds but models
    (aliases, prices, safety), next to `pools`."""
    if not config_path:
        return None
    data = yaml.safe_load(Path(config_path).expanduser().read_text()) or {}
    try:
        return ModelsConfig.model_validate({k: v for k, v in data.items() if k not in POOL_KEYS})
    except ValidationError as exc:
        raise ValueError(f"{config_path}: {exc}") from None


def run_gateway(args: argparse.Namespace) -> int:
    config = platform_config(args.config)
    if config is not None and config.models:
        raise ValueError(f"{args.config}: a gateway has pools, not models.")
    options = ReplicaOptions(
        first_byte_timeout_s=args.first_byte_timeout, stream_idle_timeout_s=args.stream_idle_timeout,
        resolve_interval_s=args.resolve_interval,
    )
    pools = parse_pools(args.pool, args.config)
    prefill_pools = parse_prefill_pools(args.prefill_pool, args.config, pools)
    disaggregation = DisaggregationOptions(min_prompt_chars=args.pd_min_prompt_chars,
                                           prefill_timeout_s=args.pd_prefill_timeout)
    app = build_gateway_app(
        pools, args.policy, options, platform=build_platform(args, config),
        aliases=configured_aliases(args, config), content_routers=config.routers if config is not None else None,
        public_metrics=args.public_metrics,
        public_openapi=args.public_openapi, allowed_origins=parse_origins(args.allowed_origins),
        max_request_body_bytes=args.max_request_body_bytes, stream_resume=resume_limits(args), api_key=args.api_key,
        prefill_pools=prefill_pools, disaggregation=disaggregation, shared_streams_url=args.redis_url,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_keep_alive=5, timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S)
    GracefulServer(config, on_signal=lambda: None, on_listening=_announce, on_deadline=app.state.end_streams,
                   shutdown_timeout=args.shutdown_timeout).run()
    return 0


def _announce(host: str, port: int) -> None:
    """Where it listens (with --port 0, the port the OS picked), for people and tests reading stdout."""
    os.write(sys.stdout.fileno(), f"llmserve: gateway at http://{host}:{port}/v1\n".encode())
