"""Keeping the cyclic garbage collector off a long-lived process's startup heap."""

from __future__ import annotations

import atexit
import functools
import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, weights' wrappers, tokenizer and template tables, the web
    framework: the process's lifetime) out of the cyclic collector's reach. Otherwise each full
    collection walks them all: in the engine at batch 256 that was a ~100 ms stall every few dozen
    steps, and the server's per-token objects trigger collections as often. Freed objects still go by
    reference counting; vLLM does the same. At exit they are handed back, so the interpreter's last
    collection sees them (extensions check for leaks then)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
