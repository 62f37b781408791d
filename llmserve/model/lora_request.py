"""A request's LoRA adapter, as it crosses from the front end to the engine core (no torch here: the server and the
gateway import it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter by name, a unique id (>= 1: the prefix cache and the slots know it by that, so an
    adapter loaded again under the same name gets a new one) and its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
