"""Qwen2: the Llama decoder with a bias on the q/k/v projections (set from the config)."""

from llmserve.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
