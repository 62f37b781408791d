"""`llmserve gateway`: the pools from --pool and --config, the platform from the same options as
`llmserve serve`'s (server/serve.py builds it), the app, and uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn
import yaml
from pydantic import ValidationError

from llmserve.gateway.app import ReplicaOptions, build_gateway_app
from llmserve.gateway.discovery import entry_host
from llmserve.gateway.pool import DNS_SCHEME
from llmserve.platform.routing import ModelsConfig
from llmserve.server.cors import parse_origins
from llmserve.server.graceful import ABORT_GRACE_S, GracefulServer
from llmserve.server.platform_options import build_platform, configured_aliases, resume_limits


def parse_pools(values: list[str], config_path: str | None) -> dict[str, list[str]]:
    """`--pool NAME=URL[,URL...]` (repeatable) joined with the config's `pools: {name: [urls]}`. A URL
    is one replica (`http://10.0.0.5:8000`), or with `dns+` every address its host name resolves to,
    re-resolved as they change (`dns+http://llmserve-replica-headless:8000`)."""
    pools: dict[str, list[str]] = {}
    if config_path:
        config = yaml.safe_load(Path(config_path).expanduser().read_text()) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a mapping (`pools: {{name: [url, ...]}}`, aliases, ...).")
        entries = config.get("pools", {})  # the pools may all come from --pool
        if not isinstance(entries, dict):
            raise ValueError(f"{config_path}: expected `pools: {{name: [url, ...]}}`.")
        for name, urls in entries.items():
            if not isinstance(urls, list) or not all(isinstance(url, str) for url in urls):
                raise ValueError(f"{config_path}: pool {name!r} must be a list of URLs.")
            pools.setdefault(str(name), []).extend(urls)
    for value in values:
        name, sep, urls = value.partition("=")
        listed = [url.strip() for url in urls.split(",") if url.strip()]
        if not sep or not name or not listed:
            raise ValueError(f"--pool {value!r}: expected NAME=URL[,URL...].")
        pools.setdefault(name, []).extend(listed)
    for name, urls in pools.items():
        bad = [url for url in urls if not url.removeprefix(DNS_SCHEME).startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"pool {name!r}: {bad[0]!r} is not an http(s) URL (or dns+http(s)).")
        for url in urls:
            if url.startswith(DNS_SCHEME):
                entry_host(url)
    if not pools:
        raise ValueError("Give at least one pool: --pool NAME=URL[,URL...] or --config with `pools:`.")
    return pools


def platform_config(config_path: str | None) -> ModelsConfig | None:
    """The platform's part of the gateway's --config: what `llmserve serve`'s --config holds but models
    (aliases, prices, safety), next to `pools`."""
    if not config_path:
        return None
    data = yaml.safe_load(Path(config_path).expanduser().read_text()) or {}
    try:
        return ModelsConfig.model_validate({k: v for k, v in data.items() if k != "pools"})
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
    app = build_gateway_app(
        parse_pools(args.pool, args.config), args.policy, options, platform=build_platform(args, config),
        aliases=configured_aliases(args, config), content_routers=config.routers if config is not None else None,
        public_metrics=args.public_metrics,
        public_openapi=args.public_openapi, allowed_origins=parse_origins(args.allowed_origins),
        max_request_body_bytes=args.max_request_body_bytes, stream_resume=resume_limits(args), api_key=args.api_key,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_keep_alive=5, timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S)
    GracefulServer(config, on_signal=lambda: None, on_listening=_announce, on_deadline=app.state.end_streams,
                   shutdown_timeout=args.shutdown_timeout).run()
    return 0


def _announce(host: str, port: int) -> None:
    """Where it listens (with --port 0, the port the OS picked), for people and tests reading stdout."""
    os.write(sys.stdout.fileno(), f"llmserve: gateway at http://{host}:{port}/v1\n".encode())
