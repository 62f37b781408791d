"""Sizing the KV pool on CUDA from a profiling pass.

Before the KV cache exists the runner runs one dummy step at the engine's limits (a forward over
max_num_batched_tokens tokens, then the sampler on max_num_seqs rows) and reads the allocator's peak.
Everything but the KV pool -- weights, the largest step's activations, sampler workspaces -- is then
known, and the pool gets what the memory budget leaves:

    kv bytes = total * gpu_memory_utilization - (peak torch allocation + memory outside torch)

Memory outside torch (the CUDA context, library workspaces, other processes) is what the device
reports in use beyond what torch's allocator has reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # device memory
    peak_torch_bytes: int  # torch's peak allocation in the profiling step, without its scratch KV cache
    non_torch_bytes: int  # in use on the device beyond torch's reserved pool

    @property
    def non_kv_bytes(self) -> int:
        return self.peak_torch_bytes + self.non_torch_bytes


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV pool; raises ValueError with the figures when nothing is left."""
    allowed = int(profile.total_bytes * utilization)
    budget = allowed - profile.non_kv_bytes
    if budget <= 0:
        raise ValueError(
            f"No memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{allowed / GiB:.2f} GiB of {profile.total_bytes / GiB:.2f} GiB, but weights and activations peak "
            f"at {profile.peak_torch_bytes / GiB:.2f} GiB and {profile.non_torch_bytes / GiB:.2f} GiB is used "
            "outside torch. Raise gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs, "
            "or use a smaller model or dtype."
        )
    return budget


def num_kv_blocks(budget_bytes: int, bytes_per_block: int) -> int:
    """Whole blocks that fit in the budget; ValueError when not even one does."""
    blocks = budget_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"The KV cache budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; "
            "give the KV cache more memory."
        )
    return blocks


def profile_prompt_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiling step: `num_tokens` tokens in prompts of at most max_model_len
    (as long as possible, since one long prompt needs the most attention scratch)."""
    if num_tokens < 1:
        raise ValueError("the profiling step needs at least one token")
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])
