"""A sparse mixture of experts in place of a decoder layer's MLP (Mixtral's, Qwen2-MoE's, Qwen3-MoE's).

A router scores every expert for each token; the token goes through its `top_k` experts' SwiGLU MLPs, whose
outputs are summed weighted by the router's softmax over all experts, cut to those k (and renormalised over
them where the model does so). The experts' weights are two stacked tensors, as vLLM and transformers 5 keep
them: `experts_gate_up` [experts, 2 x intermediate, hidden] and `experts_down` [experts, hidden, intermediate].
Qwen2-MoE adds a shared expert (`SharedExpert`), a dense SwiGLU MLP every token goes through, scaled by a gate.
Each step runs the experts that some token chose, one after another, over their tokens (one host sync for the
counts: no CUDA graphs). Under tensor parallelism each rank holds its share of every expert's features and the
ranks' sums are added, as for the dense MLP; the router is whole on every rank. With `--quantization int8`
the experts are int8 with a float32 scale per output row, each matrix quantized whole as it is read (`use_int8`);
the router stays in the model dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model import cpu_linear, parallel
from llmserve.model.layers import Linear, RMSNorm, linear
from llmserve.model.quantization.int8 import quantize_int8

# A checkpoint's expert tensor: layer, expert and which matrix (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj).
EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
GATE, UP, DOWN = "gate", "up", "down"
EXPERT_PIECES = {"w1": GATE, "gate_proj": GATE, "w3": UP, "up_proj": UP, "w2": DOWN, "down_proj": DOWN}


def sparse_layer_experts(raw: dict, layer_idx: int) -> int:
    """Qwen-MoE configs' rule: how many experts layer `layer_idx` has, 0 for a dense MLP of `intermediate_size`
    (no experts at all, the layer in `mlp_only_layers`, or not a `decoder_sparse_step`-th one)."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    sparse = layer_idx not in (raw.get("mlp_only_layers") or []) and (
        (layer_idx + 1) % int(raw.get("decoder_sparse_step", 1)) == 0)
    return experts if sparse else 0


class SharedExpert(nn.Module):
    """Qwen2-MoE's expert that every token goes through: a SwiGLU MLP whose output is scaled by
    sigmoid(shared_expert_gate(x)), one gate value a token. Split over ranks as the dense MLP is; its gate is whole
    on every rank, so the ranks' scaled shares still sum to the whole."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        intermediate = parallel.shard(intermediate_size, "the shared expert's intermediate size")
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate, False, dtype)
        self.down_proj = Linear(intermediate, hidden_size, False, dtype)
        self.gate = Linear(hidden_size, 1, False, dtype)  # one value a token: nothing to gain from quantizing it
        self.gate.quantizable = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(hidden)) * self.down_proj(self.gate_up_proj.swiglu(hidden))


class SparseMoE(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
        dtype: torch.dtype, shared_expert: SharedExpert | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.shared_expert = shared_expert
        self.intermediate = parallel.shard(intermediate_size, "the experts' intermediate size")  # this rank's
        self.gate = Linear(hidden_size, num_experts, False, dtype)  # the router, never quantized (it picks)
        self.gate.quantizable = False
        # int8 experts (`use_int8`): a float32 scale per output row of each expert's matrices; None: bf16 experts
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size, dtype=dtype),
                                            requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate, dtype=dtype),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(the experts' sum for norm(x + residual), the residual stream x + residual)."""
        hidden, residual = norm(x, residual)
        out = self.experts(hidden)
        if self.shared_expert is not None:
            out += self.shared_expert(hidden)
        return parallel.all_reduce(out), residual

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] and their weights [T, k] (in the activations' dtype)."""
        probs = torch.softmax(self.gate(hidden).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(hidden.dtype)

    def experts(self, hidden: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(hidden)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs, expert by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            gate, up = self._linear(hidden[tokens], self.experts_gate_up[expert], self.gate_up_scale, expert).chunk(
                2, dim=-1)
            y = self._linear(F.silu(gate) * up, self.experts_down[expert], self.down_scale, expert)
            y = y * flat_weights[pairs, None]
            out.index_add_(0, tokens, y)
        return out

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, expert: int) -> torch.Tensor:
        """x @ weight^T; an int8 weight's rows scaled (the CPU's int8 kernel for few bf16 rows)."""
        if scales is None:
            return linear(x, weight)
        if cpu_linear.int8_kernel_fits(x, weight):
            return cpu_linear.int8_linear(x, weight, scales[expert])
        return F.linear(x, weight.to(x.dtype)) * scales[expert].to(x.dtype)

    # ---- int8 experts (`--quantization int8`) -------------------------------------------------------
    def use_int8(self) -> None:
        """Hold the experts as int8 (empty until loaded: `load_expert` quantizes each matrix as it comes)."""
        self.experts_gate_up, self.gate_up_scale = _int8_like(self.experts_gate_up)
        self.experts_down, self.down_scale = _int8_like(self.experts_down)

    @torch.no_grad()
    def quantize_in_place(self) -> None:
        """The experts' weights (random ones: `--load-format dummy`) as int8, a scale per output row."""
        for weights, scales in (("experts_gate_up", "gate_up_scale"), ("experts_down", "down_scale")):
            stacked = getattr(self, weights)
            q, scale = quantize_int8(stacked.reshape(-1, stacked.shape[-1]))
            setattr(self, weights, nn.Parameter(q.view(stacked.shape), requires_grad=False))
            setattr(self, scales, nn.Parameter(scale.view(stacked.shape[:2]), requires_grad=False))

    def load_expert(self, expert: int, piece: str, tensor: torch.Tensor) -> None:
        """One checkpoint matrix of one expert (gate and up: [intermediate, hidden]; down: [hidden,
        intermediate]), this rank's share of its features. ValueError when its shape is another."""
        whole = self.intermediate * parallel.size()
        hidden = self.experts_down.shape[1]
        expected = (hidden, whole) if piece == DOWN else (whole, hidden)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {expected}")
        start = parallel.rank() * self.intermediate
        scale = None
        if self.down_scale is not None:  # quantized whole, then split: each rank holds what one rank would
            tensor, scale = quantize_int8(tensor)
        if piece == DOWN:
            self.experts_down.data[expert].copy_(tensor.narrow(1, start, self.intermediate))
            if scale is not None:
                self.down_scale.data[expert].copy_(scale)
            return
        offset = 0 if piece == GATE else self.intermediate
        self.experts_gate_up.data[expert].narrow(0, offset, self.intermediate).copy_(
            tensor.narrow(0, start, self.intermediate))
        if scale is not None:
            assert self.gate_up_scale is not None
            self.gate_up_scale.data[expert].narrow(0, offset, self.intermediate).copy_(
                scale.narrow(0, start, self.intermediate))


class ExpertWeights:
    """What a mixture-of-experts decoder adds to the Llama loader (`LlamaForCausalLM.load_weights`): each
    expert's checkpoint matrices into the stacked tensors, and every one of them required."""

    has_experts = True  # no CPU one-call decoder, LoRA, fp8 or CUDA graphs (they assume dense MLPs)
    layers: nn.ModuleList
    expert_pieces: set[tuple[int, int, str]]  # (layer, expert, matrix) loaded so far by `load_weights`

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing, stacked = self.missing_experts()
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"The checkpoint lacks {len(missing)} expert weight(s): {shown}")
        super()._check_complete(params, loaded | stacked)  # type: ignore[misc]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.expert_pieces = set()
        super().load_weights(weights)  # type: ignore[misc]

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        match = EXPERT_TENSOR.search(name)
        if match is None:
            return False
        layer, expert, matrix = int(match[1]), int(match[2]), match[3]
        moe = self.layers[layer].mlp if layer < len(self.layers) else None
        if not isinstance(moe, SparseMoE) or expert >= moe.num_experts:
            raise ModelLoadError(f"Checkpoint tensor {name!r} matches no expert of this model.")
        try:
            moe.load_expert(expert, EXPERT_PIECES[matrix], tensor)
        except ValueError as exc:
            raise ModelLoadError(f"Checkpoint tensor {name!r} has {exc}.") from None
        self.expert_pieces.add((layer, expert, EXPERT_PIECES[matrix]))
        return True

    def missing_experts(self) -> tuple[list[str], set[str]]:
        """The expert matrices the checkpoint lacked, and the names of the stacked parameters."""
        missing, stacked = [], set()
        for index, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                stacked |= {f"layers.{index}.mlp.{name}" for name, _ in layer.mlp.named_parameters(recurse=False)}
                missing += [f"layers.{index}.mlp.experts.{expert}.{piece}" for expert in range(layer.mlp.num_experts)
                            for piece in (GATE, UP, DOWN) if (index, expert, piece) not in self.expert_pieces]
        return missing, stacked


def _int8_like(stacked: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty int8 weights of `stacked`'s shape [experts, rows, columns], and their float32 row scales."""
    weights = torch.empty(stacked.shape, dtype=torch.int8, device=stacked.device)
    scales = torch.empty(stacked.shape[:2], dtype=torch.float32, device=stacked.device)
    return nn.Parameter(weights, requires_grad=False), nn.Parameter(scales, requires_grad=False)
