"""Plugins: modules named in `LLMSERVE_PLUGINS` (comma-separated) are imported once, in the front end
and in every engine core process, before a model is loaded, so that they can register what llmserve
does not ship, e.g. a model architecture with `llmserve.model.registry.register_model`."""

from __future__ import annotations

import functools
import importlib
import logging
import os

logger = logging.getLogger(__name__)

ENV_VAR = "LLMSERVE_PLUGINS"


@functools.cache
def load_plugins() -> tuple[str, ...]:
    names = tuple(name.strip() for name in os.environ.get(ENV_VAR, "").split(",") if name.strip())
    for name in names:
        importlib.import_module(name)
        logger.info("loaded plugin %s", name)
    return names
