"""Mixtral: the Mistral decoder with a sparse mixture of experts (moe.py) in place of every MLP: a router over
`num_local_experts` SwiGLU experts, `num_experts_per_tok` of them per token, their weights renormalised over
those chosen. Its checkpoints name the block `block_sparse_moe` and each expert's matrices w1 (gate), w3 (up)
and w2 (down)."""

from __future__ import annotations

from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.moe import ExpertWeights, SparseMoE


class MixtralForCausalLM(ExpertWeights, LlamaForCausalLM):
    renamed_weights = {"block_sparse_moe": "mlp"}

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, int(cfg.raw["num_local_experts"]),
                         int(cfg.raw["num_experts_per_tok"]), renormalize=True, dtype=cfg.dtype)
