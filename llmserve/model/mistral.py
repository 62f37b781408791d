"""Mistral: the Llama decoder. Its sliding window is honoured by capping the context at the window
(see `EngineConfig`), so attention never needs to skip keys."""

from llmserve.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
