"""Qwen3: the Llama decoder with RMSNorm on each query and key head before rotary embedding,
and an explicit head_dim (set from the config, see `ModelConfig.qk_norm`)."""

from llmserve.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
