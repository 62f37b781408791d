"""LoRA adapters in PEFT's layout (`adapter_config.json` and `adapter_model.safetensors`) on a decoder's
linear layers, several adapters in one batch (vLLM's multi-LoRA).

An adapted layer computes x W^T + s * (x A^T) B^T for each token, with the A and B of the token's adapter
(s: lora_alpha / r, or / sqrt(r) with rsLoRA). Each adapted layer holds `max_loras` slots of A and of B^T (zero
where a slot's adapter leaves the layer alone). In a decode-sized bf16 step on CPU one call of `cpu_lora` adds the
step's adapters (the one-call decoder's code); otherwise the step's tokens are grouped by slot and each group takes
a shrink (x A^T, by the layer's linear kernel) and an expand (a matmul). A fused projection (qkv, gate/up) keeps its shards' A
matrices stacked and their B matrices in a block-diagonal, so one shrink and one expand serve all its shards.

Adapters are read on the host once (`read_adapter`, which also checks them against the model) and kept in a
host cache; the slots are filled from it when a step needs an adapter that is not in one.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llmserve.errors import InvalidRequestError
from llmserve.model import cpu_lora, parallel
from llmserve.model.config import ModelConfig
from llmserve.model.layers import Linear, linear
from llmserve.model.lora_request import LoRARequest
from llmserve.model.registry import model_class

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's names for the layers of a Llama-family decoder that LoRA adapts here.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter this model cannot serve: the message says what is wrong with it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="lora_path", code="invalid_lora_adapter")


# An adapter's weights on the host, laid out as the slots hold them (padded to the maximum rank R, the scale folded
# into B): our module name -> (A [shards * R, in], B^T [shards * R, out]).
AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def supports_lora(model: nn.Module) -> bool:
    return (getattr(model, "fused_weights", None) is not None and hasattr(model, "layers")
            and not getattr(model, "has_experts", False))


def read_adapter(request: LoRARequest, model: nn.Module, max_rank: int, dtype: torch.dtype) -> AdapterWeights:
    """Read and check an adapter against `model` (a live model or its shadow on the meta device). Raises
    LoRAAdapterError naming what does not fit."""
    path = Path(request.lora_path)
    config = _adapter_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{ADAPTER_CONFIG}: `r` must be a positive integer, got {rank!r}.")
    if rank > max_rank:
        raise LoRAAdapterError(
            f"The adapter's rank {rank} is over the server's maximum LoRA rank {max_rank} (--max-lora-rank)."
        )
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{ADAPTER_CONFIG}: `lora_alpha` must be a number, got {alpha!r}.")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _read_pairs(path / ADAPTER_WEIGHTS)
    modules = dict(model.named_modules())
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for name, (a, b) in pairs.items():
        target, shard = _target(model, name, modules)
        layer = modules[target]
        sizes = _shard_sizes(model, target)
        a, b = _rank_shard(model, target, shard, sizes, a, b)
        if tuple(a.shape) != (rank, layer.weight.shape[1]) or tuple(b.shape) != (sizes[shard], rank):
            raise LoRAAdapterError(
                f"The adapter's {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model needs A "
                f"{(rank, layer.weight.shape[1])} and B {(sizes[shard], rank)}."
            )
        weights.setdefault(target, []).append((shard, a, b))
    if not weights:
        raise LoRAAdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA weights.")
    return {
        target: _lay_out(shards, _shard_sizes(model, target), modules[target].weight.shape[1], max_rank, scale, dtype)
        for target, shards in weights.items()
    }


class AdapterChecker:
    """The front end's check of adapters before a request uses one: each read against a shadow of the model
    (no storage), and each id bound to one adapter."""

    def __init__(self, model_config: ModelConfig, max_rank: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.checked: dict[int, LoRARequest] = {}
        self._shadow: nn.Module | None = None

    def check(self, request: LoRARequest) -> None:
        """Raises LoRAAdapterError (or InvalidRequestError for a reused id) when `request` cannot be served."""
        known = self.checked.get(request.lora_int_id)
        if known == request:
            return
        if isinstance(request.lora_int_id, bool) or not isinstance(request.lora_int_id, int) or request.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be a positive integer, got {request.lora_int_id!r}.",
                                      param="lora_int_id")
        if known is not None:
            raise InvalidRequestError(
                f"lora_int_id {request.lora_int_id} already names the adapter {known.lora_name!r} "
                f"({known.lora_path}); give each adapter its own id.", param="lora_int_id",
            )
        read_adapter(request, self._shadow_model(), self.max_rank, torch.float32)
        self.checked[request.lora_int_id] = request

    def _shadow_model(self) -> nn.Module:
        if self._shadow is None:
            with torch.device("meta"):
                self._shadow = model_class(self.model_config.architecture)(self.model_config)
            if not supports_lora(self._shadow) or hasattr(self._shadow, "classify"):
                raise InvalidRequestError(
                    f"LoRA adapters are served on generating Llama-family decoders, not on "
                    f"{self.model_config.architecture}.", param="model",
                )
        return self._shadow


def _adapter_config(path: Path) -> dict:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"No {ADAPTER_CONFIG} in {path}: give a PEFT LoRA adapter's directory.") from None
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"Could not read {path / ADAPTER_CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{ADAPTER_CONFIG} must hold a JSON object.")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAAdapterError(f"Only LoRA adapters are served; this one is {kind!r}.")
    unsupported = _unsupported_fields(config)
    if unsupported:
        raise LoRAAdapterError(
            f"The adapter sets {', '.join(unsupported)}, which this server does not support: LoRA weights of the "
            f"linear layers ({', '.join(TARGET_MODULES)}) with one rank and alpha are."
        )
    return config


def _unsupported_fields(config: dict) -> list[str]:
    found = [f"`{field}`" for field in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern") if config.get(field)]
    if config.get("bias", "none") != "none":
        found.append("`bias`")
    return found


def _read_pairs(file: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module name (`layers.0.self_attn.q_proj`) -> (A, B) as float32."""
    if not file.is_file():
        found = " (adapter_model.bin is not read: convert it to safetensors)" if file.with_suffix(".bin").exists() else ""
        raise LoRAAdapterError(f"No {ADAPTER_WEIGHTS} in {file.parent}{found}.")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                match = _KEY.match(key)
                if match is None:
                    raise LoRAAdapterError(
                        f"{ADAPTER_WEIGHTS} holds {key!r}, which is not a LoRA weight of a linear layer "
                        "(embedding and lm_head adapters are not supported)."
                    )
                parts.setdefault(match["module"], {})[match["part"]] = reader.get_tensor(key).float()
    except (SafetensorError, OSError) as exc:
        raise LoRAAdapterError(f"Could not read {file} (truncated or corrupt?): {exc}") from None
    lacking = [module for module, found in parts.items() if len(found) != 2]
    if lacking:
        raise LoRAAdapterError(f"{lacking[0]} has only one of lora_A and lora_B.")
    return {module: (found["A"], found["B"]) for module, found in parts.items()}


def _target(model: nn.Module, name: str, modules: dict[str, nn.Module]) -> tuple[str, int]:
    """(our linear layer's name, the shard of it) for a PEFT module name."""
    leaf = name.rsplit(".", 1)[-1]
    fused = model.fused_weights.get(leaf)  # type: ignore[union-attr]
    target, shard = (name[: -len(leaf)] + fused[0], fused[1]) if fused is not None else (name, 0)
    if leaf not in TARGET_MODULES or not isinstance(modules.get(target), Linear):
        raise LoRAAdapterError(
            f"The adapter adapts {name!r}; LoRA is served on {', '.join(TARGET_MODULES)} of this model's layers."
        )
    return target, shard


def _rank_shard(
    model: nn.Module, target: str, shard: int, sizes: list[int], a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor-parallel rank's part of an adapted layer's A and B, split as the layer's weight is: B by its rows
    where the layer's outputs are split, A by its columns where its inputs are (the rank's share of the shrink,
    summed with the layer's output over the ranks)."""
    if parallel.size() == 1:
        return a, b
    leaf = target.rsplit(".", 1)[-1]
    weight = f"{target}.weight"
    if leaf in model.row_parallel:  # type: ignore[union-attr]
        return model.rank_shard(weight, a, None), b  # type: ignore[operator]
    return a, model.rank_shard(weight, b, sizes[shard])  # type: ignore[operator]


def _shard_sizes(model: nn.Module, target: str) -> list[int]:
    leaf = target.rsplit(".", 1)[-1]
    if leaf in {fused for fused, _ in model.fused_weights.values()}:  # type: ignore[union-attr]
        return list(model.shard_sizes(leaf))  # type: ignore[operator]
    return [model.get_submodule(target).weight.shape[0]]


def _lay_out(
    shards: Sequence[tuple[int, torch.Tensor, torch.Tensor]], sizes: list[int], in_features: int, max_rank: int,
    scale: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's A [shards * R, in] and block-diagonal B^T [shards * R, out], zero where unadapted."""
    a = torch.zeros(len(sizes) * max_rank, in_features)
    bt = torch.zeros(len(sizes) * max_rank, sum(sizes))
    for shard, shard_a, shard_b in shards:
        rank, column = shard_a.shape[0], sum(sizes[:shard])
        a[shard * max_rank : shard * max_rank + rank] = shard_a
        bt[shard * max_rank : shard * max_rank + rank, column : column + sizes[shard]] = shard_b.T * scale
    return a.to(dtype), bt.to(dtype)


class LoRALayer:
    """One adapted linear layer's slots; adds the step's adapters to the layer's output."""

    def __init__(self, slots: LoRASlots, layer: Linear, shards: int) -> None:
        out_features, in_features = layer.weight.shape
        rank = shards * slots.max_rank
        device, dtype = layer.weight.device, slots.dtype
        self.slots = slots
        self.a = torch.zeros(slots.max_loras, rank, in_features, device=device, dtype=dtype)
        self.bt = torch.zeros(slots.max_loras, rank, out_features, device=device, dtype=dtype)

    @property
    def active(self) -> bool:
        return bool(self.slots.groups)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter's (x A^T) B^T, in place: for bf16 on CPU by `cpu_lora` in one call (the
        one-call decoder's arithmetic), else per slot a shrink by the layer's kernel and an expand by a matmul."""
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if self.slots.token_slots is not None and cpu_lora.runs(out2, self.a.shape[1]):
            cpu_lora.add(out2, x2, self.slots.token_slots, self.a, self.bt)
            return out
        for slot, rows in self.slots.groups:
            if rows is None:
                out2.add_(linear(x2, self.a[slot]) @ self.bt[slot])
            else:
                out2.index_add_(0, rows, linear(x2.index_select(0, rows), self.a[slot]) @ self.bt[slot])
        return out


class LoRASlots:
    """The adapters a step may use: `max_loras` slots in every adaptable layer, a host cache of read adapters
    (`max_cpu_loras`, beyond which the least recently used adapter no live request names is dropped), and the
    current step's token groups."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.dtype = dtype
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, Linear) and _is_adaptable(model, leaf):
                layer = LoRALayer(self, module, len(_shard_sizes(model, name)))
                module.lora = layer
                self.layers[name] = layer
        self.cached: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # this step's (slot, token rows; None: all)
        self.token_slots: torch.Tensor | None = None  # this step's slot of each token (-1: none), int32

    def add(self, request: LoRARequest, in_use: Callable[[], Collection[int]] = frozenset) -> None:
        """Have `request`'s adapter in the host cache (read on first use; LoRAAdapterError when it does not
        fit). `in_use()`: the ids live requests name, never dropped to make room (asked only when room is made)."""
        if request.lora_int_id in self.cached:
            self.cached.move_to_end(request.lora_int_id)
            return
        adapter = read_adapter(request, self.model, self.max_rank, self.dtype)
        self.cached[request.lora_int_id] = adapter
        if len(self.cached) <= self.max_cpu_loras:
            return
        kept = {request.lora_int_id, *in_use()}
        for old in [i for i in self.cached if i not in kept]:
            if len(self.cached) <= self.max_cpu_loras:
                break
            del self.cached[old]
            self.slot_of.pop(old, None)

    def activate(self, row_ids: Sequence[int], num_new: np.ndarray, device: torch.device) -> None:
        """Set the step's groups: rows are sequences with `num_new` tokens each, `row_ids` their adapters
        (0: none). Adapters not in a slot are copied into one that this step does not use."""
        self.groups, self.token_slots = [], None
        ids = set(row_ids) - {0}
        if not ids:
            return
        for lora_id in ids:
            self._ensure_slot(lora_id, ids)
        row_slots = np.array([self.slot_of.get(i, -1) for i in row_ids], dtype=np.int32)
        token_slots = np.repeat(row_slots, num_new)
        self.token_slots = torch.from_numpy(token_slots).to(device)
        if len(ids) == 1 and (row_slots >= 0).all():
            self.groups = [(int(row_slots[0]), None)]
            return
        for slot in sorted(self.slot_of[i] for i in ids):
            self.groups.append((slot, torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device)))

    def _ensure_slot(self, lora_id: int, needed: Collection[int]) -> None:
        if lora_id in self.slot_of:
            return
        adapter = self.cached.get(lora_id)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {lora_id} is not in the host cache")
        taken = {slot for i, slot in self.slot_of.items() if i in needed}
        slot = next((s for s in range(self.max_loras) if s not in taken), None)
        if slot is None:
            raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
        for old in [i for i, s in self.slot_of.items() if s == slot]:
            del self.slot_of[old]
        for name, layer in self.layers.items():
            weights = adapter.get(name)
            if weights is None:
                layer.a[slot].zero_()
                layer.bt[slot].zero_()
            else:
                layer.a[slot].copy_(weights[0])
                layer.bt[slot].copy_(weights[1])
        self.slot_of[lora_id] = slot


def _is_adaptable(model: nn.Module, leaf: str) -> bool:
    fused = {fused for fused, _ in model.fused_weights.values()}  # type: ignore[union-attr]
    return leaf in fused or leaf in TARGET_MODULES

