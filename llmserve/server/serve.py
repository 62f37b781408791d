"""`llmserve serve`: the engine, the app and uvicorn, with a graceful shutdown on SIGTERM.

SIGTERM (or Ctrl+C): new requests (and /health) get a 503 `shutting_down` at once, which a gateway
takes as "draining": it sends nothing new but lets what runs finish. The server keeps listening until
no request is left running, then stops listening; in-flight requests run to completion for up to
--shutdown-timeout seconds from the signal (then each one still running is aborted: a
stream gets an error event and `data: [DONE]`, and its usage is recorded as `aborted_by_server`),
the engine stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from llmserve.config import EngineConfig, engine_config_kwargs
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.keys import KeyStore
from llmserve.platform.routing import ModelsConfig
from llmserve.server.app import ModelSpec, build_app
from llmserve.server.cors import parse_origins
from llmserve.server.gateway import Platform
from llmserve.server.graceful import ABORT_GRACE_S, GracefulServer
from llmserve.server.platform_options import build_platform, configured_aliases, resume_limits
from llmserve.server.slo import SLO

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "llmserve-default"


def served_name(model_arg: str | None) -> str:
    """The default model name: "llmserve-default" for the built-in model, a local directory's name,
    or the hub id as given."""
    if model_arg is None:
        return DEFAULT_SERVED_NAME
    path = Path(model_arg).expanduser()
    return path.resolve().name if path.is_dir() else model_arg


def resolve_model(model_arg: str | None) -> str:
    if model_arg is not None:
        return model_arg
    from llmserve.model.builtin import DEFAULT_ARCH, DEFAULT_SIZE, ensure_default_model

    return str(ensure_default_model(DEFAULT_ARCH, DEFAULT_SIZE))


@dataclass
class ModelArg:
    name: str
    model: str | None  # None: the built-in model
    engine_overrides: dict = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)  # other names (the --model path as typed)


def parse_model_args(values: list[str] | None, served_model_name: str | None) -> list[ModelArg]:
    """`--model [NAME=]MODEL`, repeated; one unnamed model takes --served-model-name."""
    if not values:
        return [ModelArg(served_model_name or DEFAULT_SERVED_NAME, None)]
    parsed = []
    for value in values:
        name, sep, model = value.partition("=")
        if not sep:
            name, model = "", value
        if not model:
            raise ValueError(f"--model {value!r}: give a checkpoint directory or hub id.")
        aliases = [] if sep else [model]
        parsed.append(ModelArg(name or served_name(model), model, aliases=aliases))
    if served_model_name is not None:
        if len(parsed) > 1:
            raise ValueError("--served-model-name names one model; name several with --model NAME=MODEL.")
        parsed[0].name = served_model_name
    names = [m.name for m in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"Two models have the same name: {names}. Name them with --model NAME=MODEL.")
    return parsed


def _model_args(args: argparse.Namespace, config: ModelsConfig | None) -> list[ModelArg]:
    if config is not None and config.models:
        if args.model:
            raise ValueError("Give the models either with --model or in --config, not both.")
        return [ModelArg(m.name, m.model, m.engine.model_dump(exclude_unset=True)) for m in config.models]
    return parse_model_args(args.model, args.served_model_name)


def _model_specs(args: argparse.Namespace, models: list[ModelArg]) -> list[ModelSpec]:
    if args.lora_modules and len(models) > 1:
        raise ValueError("--lora-modules names the adapters of one model; with several models, give each its "
                         "engine's lora_modules in --config.")
    specs = []
    for model in models:
        kwargs = {**engine_config_kwargs(args), **model.engine_overrides}

        def load(model: ModelArg = model, kwargs: dict = kwargs) -> AsyncLLM:
            path = resolve_model(model.model)
            return AsyncLLM.from_config(EngineConfig(model=path, served_model_name=model.name, **kwargs))

        root = None if model.model is None or _is_local_path(model.model) else model.model  # a hub id
        specs.append(ModelSpec(
            model.name, load=load, root=root, max_waiting_requests=args.max_waiting_requests,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        ))
    return specs


def _is_local_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


def _aliases(args: argparse.Namespace, config: ModelsConfig | None, models: list[ModelArg]) -> dict:
    """--alias and the config's aliases, plus each unnamed --model as typed (clients may send the path)."""
    names = {m.name for m in models}
    aliases: dict[str, list[tuple[str, float]]] = {
        typed: [(m.name, 1.0)] for m in models for typed in m.aliases if typed not in names
    }
    return {**aliases, **configured_aliases(args, config)}


def _check_tier_priorities(args: argparse.Namespace, models: list[ModelArg], platform: Platform | None) -> None:
    """The config's tier priorities order requests only where the scheduler goes by priority."""
    if platform is None or not platform.tier_priorities:
        return
    first_come = [m.name for m in models
                  if {**engine_config_kwargs(args), **m.engine_overrides}.get("scheduling_policy", "fcfs") != "priority"]
    if first_come:
        raise SystemExit(f"llmserve serve: the config's tiers set priorities, which need --scheduling-policy "
                         f"priority (first come, first served: {', '.join(first_come)})")


def make_app(args: argparse.Namespace, config: ModelsConfig | None, platform: Platform | None) -> FastAPI:
    """The app `llmserve serve` runs; its models load in threads once it starts."""
    models = _model_args(args, config)
    _check_tier_priorities(args, models, platform)
    return build_app(
        models=_model_specs(args, models),
        aliases=_aliases(args, config, models),
        content_routers=config.routers if config is not None else None,
        unlisted_aliases={typed for m in models for typed in m.aliases},  # /v1/models shows names, not paths
        owns_engine=True,
        shutdown_timeout=args.shutdown_timeout,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
        platform=platform,
        public_metrics=args.public_metrics,
        public_openapi=args.public_openapi,
        allowed_origins=parse_origins(args.allowed_origins),
        allowed_media_domains=parse_origins(args.allowed_media_domains),
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes,
        stream_resume=resume_limits(args),
        shared_streams_url=args.redis_url,
        api_key=args.api_key,
    )


def run_server(args: argparse.Namespace) -> int:
    from llmserve.platform.routing import load_models_config

    config = load_models_config(args.config) if args.config else None
    platform = build_platform(args, config)
    app = make_app(args, config, platform)
    config_uv = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
        timeout_keep_alive=5,
    )
    state = app.state.llmserve
    names = ", ".join(state.router.model_names())

    def on_signal() -> None:
        state.draining = True
        _announce("llmserve: shutting down, finishing in-flight requests")

    def on_deadline() -> None:
        """Past --shutdown-timeout: each request still running ends with an error (a stream gets an
        error event, then [DONE]) and is metered as aborted by the server."""
        if platform is not None:
            platform.aborting = True
        for endpoint in state.endpoints():
            state.background(endpoint.engine.shutdown(0))

    def on_listening(host: str, port: int) -> None:
        _announce(f"llmserve: listening at http://{host}:{port}/v1, loading {names}")
        if (not args.api_key and platform is not None and platform.database is not None
                and not KeyStore(platform.database).has_active_keys()):
            _announce(
                "llmserve: no API keys exist, so the server is open to anyone who can reach it (local mode); "
                "`llmserve keys create --name NAME` turns on authentication"
            )

        async def announce_when_ready() -> None:
            await state.wait_ready()
            failed = state.router.failed_names()
            if failed:
                _announce(f"llmserve: could not load {', '.join(failed)} (requests for it get a 503)")
            _announce(f"llmserve: serving {names} at http://{host}:{port}/v1")

        state.background(announce_when_ready())

    try:
        GracefulServer(
            config_uv, on_signal, on_listening, on_deadline, args.shutdown_timeout, drain_listening=True
        ).run()  # on uvloop when it is installed
    finally:
        for endpoint in state.endpoints():
            endpoint.engine.close(timeout=args.shutdown_timeout)
    return 0


def _announce(message: str) -> None:
    # May run inside a signal handler: one unbuffered write, no logging locks.
    os.write(sys.stdout.fileno(), (message + "\n").encode())
