from llmserve.model.attention.base import AttentionBackend, AttentionMetadata
from llmserve.model.attention.torch_ref import TorchAttentionBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}.")
    return BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "BACKENDS", "get_backend"]
