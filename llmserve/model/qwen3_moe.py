"""Qwen3-MoE: the Qwen3 decoder (q/k norms) with a sparse mixture of experts (moe.py) in place of the MLP of
every `decoder_sparse_step`-th layer not in `mlp_only_layers` (those keep a dense MLP of `intermediate_size`):
`num_experts` SwiGLU experts of `moe_intermediate_size`, `num_experts_per_tok` per token, their weights
renormalised over those chosen only with `norm_topk_prob`. No shared expert."""

from __future__ import annotations

from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.llama import MLP, LlamaForCausalLM
from llmserve.model.moe import ExpertWeights, SparseMoE, sparse_layer_experts


class Qwen3MoeForCausalLM(ExpertWeights, LlamaForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        raw = cfg.raw
        experts = sparse_layer_experts(raw, layer_idx)
        if not experts:
            return MLP(cfg)
        return SparseMoE(cfg.hidden_size, int(raw["moe_intermediate_size"]), experts, int(raw["num_experts_per_tok"]),
                         renormalize=bool(raw.get("norm_topk_prob", False)), dtype=cfg.dtype)
