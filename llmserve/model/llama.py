"""The Llama decoder, read top to bottom. Qwen2, Qwen3 and Mistral reuse it with small differences.

The forward pass works on a flattened batch: `input_ids` and `positions` are 1-D over every token
scheduled this step (decode tokens and prefill chunks of many sequences together, no padding), and the
attention backend reads each sequence's earlier context from the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model import parallel
from llmserve.model.attention import AttentionBackend, AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.layers import Embedding, Linear, MRotaryEmbedding, RMSNorm, RotaryEmbedding, linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = parallel.shard(cfg.num_attention_heads, "the attention heads")  # this rank's
        self.num_kv_heads = parallel.shard_kv_heads(cfg.num_key_value_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, cfg.dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, cfg.dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
        kv_cache: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention of norm(x + residual), the residual stream x + residual): the layer's input norm runs
        with the qkv projection (`Linear.after_norm`)."""
        tokens = x.shape[0]
        qkv, residual = self.qkv_proj.after_norm(x, norm, residual)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.rotary, positions)
        return parallel.all_reduce(self.o_proj(out.reshape(tokens, self.q_size))), residual


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        intermediate = parallel.shard(cfg.intermediate_size, "the MLP's intermediate size")  # this rank's
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, cfg.mlp_bias, cfg.dtype)
        self.down_proj = Linear(intermediate, cfg.hidden_size, cfg.mlp_bias, cfg.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP of norm(x + residual), the residual stream x + residual)."""
        hidden, residual = self.gate_up_proj.after_norm(x, norm, residual, swiglu=True)
        return parallel.all_reduce(self.down_proj(hidden)), residual


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
        make_mlp: Callable[[ModelConfig, int], nn.Module],
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(cfg, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = make_mlp(cfg, layer_idx)  # MLP, or a mixture of experts (moe.py)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds them, fused into the
        next norm. `residual` is None for the first layer, whose input is the residual stream itself."""
        hidden, residual = self.self_attn(positions, x, residual, self.input_layernorm, kv_cache, backend, meta)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensors that are stored separately but live in one fused matrix here:
    # checkpoint name fragment -> (our fragment, shard index).
    fused_weights: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    ignored_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)
    # Checkpoint name fragments for modules named otherwise here (Mixtral's `block_sparse_moe` is our `mlp`).
    renamed_weights: dict[str, str] = {}
    # Split by their input features over tensor-parallel ranks (the rest of the fused ones by their outputs).
    row_parallel: tuple[str, ...] = ("o_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary_class = RotaryEmbedding if cfg.rope.mrope_section is None else MRotaryEmbedding
        rotary = rotary_class(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope)
        self.rotary = rotary
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, self.make_mlp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.dtype)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP (a mixture-of-experts model's are its experts)."""
        return MLP(cfg)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend, meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the tokens' input embeddings when they are not all the embedding table's (a
        vision-language model's image features in place of its placeholders)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, backend, meta)
        if residual is None:  # no layers
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # through its quant_method when it is quantized

    # ---- weight loading -------------------------------------------------------------------------
    def shard_sizes(self, fused: str) -> list[int]:
        """The rows each checkpoint tensor of a fused matrix fills in this rank's shard."""
        cfg, ranks = self.config, parallel.size()
        if fused == "qkv_proj":
            kv_rows = parallel.shard_kv_heads(cfg.num_key_value_heads) * cfg.head_dim
            return [cfg.num_attention_heads * cfg.head_dim // ranks, kv_rows, kv_rows]
        return [cfg.intermediate_size // ranks] * 2

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if any(hf_name.endswith(s) for s in self.ignored_weights):
                continue
            for fragment, ours in self.renamed_weights.items():
                hf_name = hf_name.replace(f".{fragment}.", f".{ours}.")
            if self.load_special(hf_name, tensor):
                continue
            name, offset, size = self._locate(hf_name)
            tensor = self.rank_shard(name, tensor, size)
            if name not in params:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied checkpoints sometimes store the tied copy too
                raise ModelLoadError(f"Checkpoint tensor {hf_name!r} matches no parameter of {self.config.architecture}.")
            target = params[name].data if size is None else params[name].data.narrow(0, offset, size)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"Checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}."
                )
            target.copy_(tensor)
            loaded.add(name if size is None else f"{name}#{offset}")
        self._check_complete(params, loaded)

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        """Load a checkpoint tensor the generic way below cannot (a mixture of experts' stacked experts);
        False: none of those."""
        return False

    def rank_shard(self, name: str, tensor: torch.Tensor, piece_rows: int | None) -> torch.Tensor:
        """This tensor-parallel rank's part of a checkpoint tensor: a fused matrix's piece by its rows (heads,
        features; `piece_rows` of them, from `shard_sizes`; its quantization scales too), a row-parallel weight by
        its columns; a row-parallel bias is added once, after the ranks' sum. Weights quantized at load were
        quantized whole, so each rank holds the same quantized values one rank would."""
        ranks, rank = parallel.size(), parallel.rank()
        if ranks == 1:
            return tensor
        if piece_rows is not None:
            heads = tensor.shape[0] // self.config.head_dim
            if ".qkv_proj." in name and heads == self.config.num_key_value_heads < ranks:  # a replicated kv head
                return tensor.narrow(0, parallel.kv_head(heads) * piece_rows, piece_rows)
            return tensor.narrow(0, rank * piece_rows, piece_rows)
        if any(f".{part}." in name for part in self.row_parallel):
            if name.endswith(".bias"):
                return tensor if rank == 0 else torch.zeros_like(tensor)
            if name.endswith(".weight"):  # a quantized one's per-output-row scales stay whole
                columns = tensor.shape[1] // ranks
                return tensor.narrow(1, rank * columns, columns)
        return tensor

    def _locate(self, hf_name: str) -> tuple[str, int, int | None]:
        name = hf_name.removeprefix("model.")
        for fragment, (fused, shard) in self.fused_weights.items():
            if f".{fragment}." in name:
                sizes = self.shard_sizes(fused)
                return name.replace(fragment, fused), sum(sizes[:shard]), sizes[shard]
        return name, 0, None

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            fused = next((f for f, _ in self.fused_weights.values() if f".{f}." in name), None)
            if fused is None:
                if name not in loaded:
                    missing.append(name)
                continue
            sizes = self.shard_sizes(fused)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            missing += [f"{name}[{o}]" for o in offsets if f"{name}#{o}" not in loaded]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"The checkpoint lacks {len(missing)} weight(s): {shown}")

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights in place (vLLM's --load-format dummy): for benchmarks without a checkpoint."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if "norm" in name:
                param.data.fill_(1.0)
            else:
                param.data.copy_(torch.randn(param.shape, generator=gen) * std)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The decoder with transformers' `score` head on each sequence's last token and no language-model head:
    reward models, and decoder rerankers in their classifier form (Qwen3-Reranker's seq-cls checkpoints). Qwen2,
    Qwen3 and Mistral's differ only in their config. It does not generate."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.lm_head = None
        self.score = Linear(cfg.hidden_size, cfg.num_labels, False, cfg.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A checkpoint of this class as it is; a causal LM's with `classifier_from_token_ids` in its config (see
        `model_facts`): the head made from those tokens' rows of its language-model head."""
        ids = self.config.raw.get("classifier_from_token_ids")
        super().load_weights(weights if ids is None else self._head_from_tokens(weights, ids))

    def _head_from_tokens(
        self, weights: Iterable[tuple[str, torch.Tensor]], ids: list[int]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        for name, tensor in weights:
            if name == head:
                rows = tensor[ids].float()
                yield "score.weight", (rows[1:] - rows[:1]) if len(ids) == 2 else rows
            if name != "lm_head.weight":
                yield name, tensor

    def classify(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] float32 logits from each sequence's last hidden state ([rows, hidden])."""
        return self.score(last_tokens.to(self.score.weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.config.architecture} classifies: it has no language-model head.")
