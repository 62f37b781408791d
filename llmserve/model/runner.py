"""The model runner: owns the weights and the KV cache tensors, turns a scheduled batch into one
forward pass over its flattened tokens, and samples the next tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Sequence_

import torch

from llmserve.config import EngineConfig
from llmserve.engine.sequence import Sequence
from llmserve.model.attention import AttentionMetadata, get_backend
from llmserve.model.config import ModelConfig, parse_dtype
from llmserve.model.loader import iterate_weights
from llmserve.model.registry import model_class
from llmserve.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = model_config.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        model_config.dtype = self.dtype
        self.block_size = config.block_size
        self.model = self._load_model(model_dir, max_model_len)
        backend_name = config.attention_backend or "torch"
        self.attn_backend = get_backend(backend_name)(
            model_config.num_attention_heads, model_config.num_key_value_heads, model_config.head_dim, self.block_size,
            self.dtype,
        )
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.sampler = Sampler()

    # ---- setup ----------------------------------------------------------------------------------
    def _load_model(self, model_dir, max_model_len: int) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        with torch.device(self.device):
            model = cls(self.model_config, max_positions=max_model_len)
        if self.config.load_format == "dummy":
            model.init_dummy_weights(self.config.seed)
        else:
            model.load_weights(iterate_weights(model_dir))
        return model.eval()

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        budget = self.config.kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free)
        return max(1, budget // per_block)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = self.attn_backend.kv_cache_shape(num_blocks)
        # Zeros, not empty: padded block-table entries read block contents that the mask then ignores,
        # and uninitialised memory could hold NaNs that survive a zero attention weight.
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.model_config.num_hidden_layers)
        ]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        batch: list[tuple[Sequence, int]],
        logits_rows: list[int],
        sampling_rows: list[SamplingRow],
        blocks_to_copy: Sequence_[tuple[int, int]] = (),
    ) -> SamplerOutput | None:
        """Copy the (src, dst) blocks of `blocks_to_copy`, run `batch` (decodes first) and sample one
        token per entry of `logits_rows` (an index into `batch`: that sequence's last scheduled token
        gives the logits)."""
        if blocks_to_copy:
            self.copy_blocks(blocks_to_copy)
        input_ids, positions, meta = self.prepare_inputs(batch)
        self.attn_backend.prepare(meta)
        hidden = self.model(input_ids, positions, self.kv_caches, self.attn_backend, meta)
        if not logits_rows:
            return None  # only partial prefill chunks: the KV cache was the point
        last_token = meta.query_start_loc[1:] - 1
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[last_token[rows].long()])
        sampling = SamplingMetadata.build(sampling_rows, logits.shape[-1], self.device)
        return self.sampler(logits, sampling)

    def copy_blocks(self, blocks_to_copy: Sequence_[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer's keys and values (block is the caches' first dimension)."""
        src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    def prepare_inputs(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        num_decodes = 0
        for seq, num_new in batch:
            begin = seq.num_computed_tokens
            end = begin + num_new
            tokens.extend(seq.token_ids[begin:end])
            positions.extend(range(begin, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            starts.append(starts[-1] + num_new)
            seq_lens.append(end)
            if num_new == 1 and num_decodes == len(seq_lens) - 1:
                num_decodes += 1  # decodes lead the batch; count the leading run
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_seq_len=max(seq_lens),
            query_start_loc_host=starts,
            seq_lens_host=seq_lens,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=dev), meta
