"""Engine configuration: what a user sets (the model, memory, batching limits) with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    revision: str | None = None
    dtype: str = "auto"  # auto: the checkpoint's dtype on CPU; bfloat16 on CUDA unless the checkpoint is float16
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    load_format: str = "auto"  # auto | dummy (random weights from the config, no checkpoint read)
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 4 * GiB  # bytes for the KV pool (CPU; on CUDA see gpu_memory_utilization)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True  # share full KV blocks by content across requests
    attention_backend: str | None = None  # None: the best for the device ("triton" on CUDA, else "torch")
    enforce_eager: bool = False  # never use CUDA graphs (they are only used on CUDA anyway)
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes to capture; None: 1, 2, 4, 8, 16, 32, ...
    served_model_name: str | None = None

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1.")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        if self.cuda_graph_sizes is not None and any(size < 1 for size in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}.")
