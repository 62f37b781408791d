"""Which model class serves which `architectures` entry of a config.json."""

from __future__ import annotations

from torch import nn

from llmserve.errors import UnsupportedArchitectureError
from llmserve.model.bert import BertForSequenceClassification, BertModel
from llmserve.model.llama import LlamaForCausalLM, LlamaForSequenceClassification
from llmserve.model.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from llmserve.model.mistral import MistralForCausalLM
from llmserve.model.mixtral import MixtralForCausalLM
from llmserve.model.qwen2 import Qwen2ForCausalLM
from llmserve.model.qwen2_moe import Qwen2MoeForCausalLM
from llmserve.model.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from llmserve.model.qwen3 import Qwen3ForCausalLM
from llmserve.model.qwen3_moe import Qwen3MoeForCausalLM
from llmserve.model.roberta import RobertaForSequenceClassification, RobertaModel

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "BertForSequenceClassification": BertForSequenceClassification,
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "MistralForCausalLM": MistralForCausalLM,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "RobertaModel": RobertaModel,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaModel": RobertaModel,
}


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    """Serve `architecture` (a config.json `architectures` entry) with `cls` (from a plugin)."""
    MODEL_REGISTRY[architecture] = cls


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise UnsupportedArchitectureError(
            f"Architecture {architecture!r} is not supported; supported architectures: {supported}."
        ) from None
