from llmserve.model.attention.base import AttentionBackend, AttentionMetadata
from llmserve.model.attention.torch_ref import TorchAttentionBackend
from llmserve.model.attention.triton_backend import TritonAttentionBackend

# The triton backend imports triton (and compiles its kernels) only when constructed.
BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def get_backend(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; available: {', '.join(sorted(BACKENDS))}.")
    return BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "TritonAttentionBackend", "BACKENDS", "get_backend"]
