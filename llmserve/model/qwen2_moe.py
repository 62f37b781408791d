"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (a bias on q/k/v) whose MLP in every
`decoder_sparse_step`-th layer not in `mlp_only_layers` is a sparse mixture of experts (moe.py) plus a shared
expert: `num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` a token (renormalised over
those chosen only with `norm_topk_prob`), and a dense SwiGLU MLP of `shared_expert_intermediate_size` that every
token goes through, scaled by sigmoid(`shared_expert_gate`)."""

from __future__ import annotations

from torch import nn

from llmserve.model import parallel
from llmserve.model.config import ModelConfig
from llmserve.model.llama import MLP, LlamaForCausalLM
from llmserve.model.moe import ExpertWeights, SharedExpert, SparseMoE, sparse_layer_experts

SHARED_GATE_UP = "shared_expert.gate_up_proj"


class Qwen2MoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    # The shared expert's gate and up matrices fill its own fused matrix, listed first so that they match before
    # the dense MLP's (whose fragments they contain).
    fused_weights = {
        "shared_expert.gate_proj": (SHARED_GATE_UP, 0),
        "shared_expert.up_proj": (SHARED_GATE_UP, 1),
        **LlamaForCausalLM.fused_weights,
    }
    renamed_weights = {"shared_expert_gate": "shared_expert.gate"}

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        raw = cfg.raw
        experts = sparse_layer_experts(raw, layer_idx)
        if not experts:
            return MLP(cfg)
        shared = None
        if int(raw.get("shared_expert_intermediate_size") or 0):
            shared = SharedExpert(cfg.hidden_size, int(raw["shared_expert_intermediate_size"]), cfg.dtype)
        return SparseMoE(cfg.hidden_size, int(raw["moe_intermediate_size"]), experts, int(raw["num_experts_per_tok"]),
                         renormalize=bool(raw.get("norm_topk_prob", False)), dtype=cfg.dtype, shared_expert=shared)

    def shard_sizes(self, fused: str) -> list[int]:
        if fused == SHARED_GATE_UP:
            return [int(self.config.raw["shared_expert_intermediate_size"]) // parallel.size()] * 2
        return super().shard_sizes(fused)
