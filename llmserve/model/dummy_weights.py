"""Random weights in place (vLLM's `--load-format dummy`): an engine from a config alone, no checkpoint.

Every parameter is filled where it already lives, on the target device and in the target dtype, with
a generator on that device, so an 8B-shaped model never makes a float32 copy on the host. A large
parameter gets one block of DUMMY_PERIOD fresh N(0, std) values repeated over it: a prime period, so
no two rows of a matrix are equal, and filling costs a memory copy rather than a random draw per
element (drawing 8 billion normals takes minutes on a CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model import parallel

DUMMY_STD = 0.02
DUMMY_PERIOD = 1_000_003  # prime
PARAMETERS_PER_SEED = 1 << 20  # seeds of different models' parameters never meet


def init_dummy_weights_(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Norm weights 1, everything else N(0, std) values; deterministic for a seed on a given device. Split over
    tensor-parallel ranks, each parameter draws from its own seed, so those whole on every rank (embeddings, the
    head) are the same on each, however large the split ones before them."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
            elif param.device.type == "meta":  # shapes only, nothing to draw
                param.normal_(0.0, std)
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
                if parallel.size() > 1:
                    generators[param.device].manual_seed(seed * PARAMETERS_PER_SEED + index)
                _fill_normal_(param.view(-1), std, generators[param.device])


def _fill_normal_(flat: torch.Tensor, std: float, generator: torch.Generator) -> None:
    if flat.device.type == "cpu" and flat.numel() > DUMMY_PERIOD:
        flat.zero_()  # fault fresh pages in with one big write: faulting them chunk by chunk is ~2x slower
    block = flat[:DUMMY_PERIOD].normal_(0.0, std, generator=generator)
    for start in range(DUMMY_PERIOD, flat.numel(), DUMMY_PERIOD):
        chunk = flat[start : start + DUMMY_PERIOD]
        chunk.copy_(block[: chunk.numel()])
