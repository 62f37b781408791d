"""The BERT encoder (sentence-transformers' all-MiniLM and its kin), read top to bottom.

It works on the same flattened batch as the decoders (`input_ids` and `positions` 1-D over every
token of the step, sequences one after another, no padding), but attention is bidirectional within
each sequence, so a sequence is always computed whole in one step and nothing is cached: the model
takes no KV cache and has no language-model head. Absolute position embeddings, token types (0, or 1 for
the second text of a pair), post-layer-norm residual blocks and exact (erf) GELU, as Hugging Face's
`BertModel` computes them.

`BertForSequenceClassification` (a cross-encoder reranker such as ms-marco-MiniLM, or any text
classifier) adds transformers' head on the first token: a tanh-activated dense layer, then the label
logits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model.attention import AttentionBackend, AttentionMetadata
from llmserve.model.config import ModelConfig
from llmserve.model.layers import Embedding, Linear


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


# A group of sequences padded to its longest may waste at most this share of its attention work.
MAX_PADDING_WASTE = 0.25
MAX_GROUP_SIZE = 64


@dataclass
class _Group:
    """Sequences of about the same length, attended in one padded call."""

    # [size * length] each padded position's token; padding repeats a token of the group (a masked
    # key, a query whose output is dropped: any finite values do)
    gather: torch.Tensor
    mask: torch.Tensor | None  # [size, 1, 1, length] keys that are tokens; None when none is padding
    size: int
    length: int


class PackedLayout:
    """How a step's packed sequences (tokens starts[i]:starts[i + 1]) are attended: sorted by length
    into groups that pad little, one attention call per group, the results put back in token order.
    Built once per step, used by every layer."""

    def __init__(self, starts: list[int], device: torch.device) -> None:
        lengths = [end - begin for begin, end in zip(starts[:-1], starts[1:], strict=True)]
        num_tokens = starts[-1]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        self.groups: list[_Group] = []
        placed = torch.empty(num_tokens, dtype=torch.int64)  # each token's row among the padded outputs
        offset = 0
        while order:
            members = _take_group(order, lengths)
            length = lengths[members[0]]
            gather = torch.full((len(members), length), starts[members[0]], dtype=torch.int64)
            mask = torch.zeros(len(members), 1, 1, length, dtype=torch.bool)
            for j, i in enumerate(members):
                tokens = torch.arange(starts[i], starts[i + 1])
                gather[j, : lengths[i]] = tokens
                mask[j, ..., : lengths[i]] = True
                placed[tokens] = torch.arange(lengths[i]) + offset + j * length
            offset += len(members) * length
            padded = any(lengths[i] != length for i in members)
            self.groups.append(_Group(
                gather.view(-1).to(device), mask.to(device) if padded else None, len(members), length
            ))
        self.scatter = placed.to(device)


def _take_group(order: list[int], lengths: list[int]) -> list[int]:
    """Pop from `order` (longest first) the next group: while padding to its longest wastes little."""
    members = [order.pop(0)]
    longest, total = lengths[members[0]], lengths[members[0]]
    while order and len(members) < MAX_GROUP_SIZE:
        candidate = lengths[order[0]]
        if longest * (len(members) + 1) > (total + candidate) * (1 + MAX_PADDING_WASTE):
            break
        members.append(order.pop(0))
        total += candidate
    return members


def bidirectional_attention(
    qkv: torch.Tensor, layout: PackedLayout, num_heads: int, head_dim: int, scale: float
) -> torch.Tensor:
    """Every token attending to every token of its own sequence: `qkv` [T, 3 * heads * head_dim] in,
    [T, heads * head_dim] out, with little padding (see `PackedLayout`)."""
    outputs = []
    for group in layout.groups:
        x = qkv.index_select(0, group.gather).view(group.size, group.length, 3, num_heads, head_dim)
        q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # [size, heads, length, head_dim] each
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        outputs.append(out.transpose(1, 2).reshape(group.size * group.length, num_heads * head_dim))
    return torch.cat(outputs).index_select(0, layout.scatter)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = Linear(hidden, 3 * hidden, True, cfg.dtype)
        self.attention_output = Linear(hidden, hidden, True, cfg.dtype)
        self.attention_norm = LayerNorm(hidden, eps, cfg.dtype)
        self.intermediate = Linear(hidden, cfg.intermediate_size, True, cfg.dtype)
        self.output = Linear(cfg.intermediate_size, hidden, True, cfg.dtype)
        self.output_norm = LayerNorm(hidden, eps, cfg.dtype)

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        attended = bidirectional_attention(self.qkv(x), layout, self.num_heads, self.head_dim, self.scale)
        x = self.attention_norm(x + self.attention_output(attended))
        hidden = nn.functional.gelu(self.intermediate(x))
        return self.output_norm(x + self.output(hidden))


class BertModel(nn.Module):
    is_encoder = True  # bidirectional, no KV cache, no generation
    weight_prefix = "bert."  # what a *ForSequenceClassification checkpoint puts before the encoder's names
    uses_token_types = True  # a text pair's second text is token type 1

    # Checkpoint name fragment -> ours; query, key and value are fused into one matrix (in that order).
    renamed_weights: dict[str, str] = {
        "attention.output.dense.": "attention_output.",
        "attention.output.LayerNorm.": "attention_norm.",
        "intermediate.dense.": "intermediate.",
        "output.dense.": "output.",
        "output.LayerNorm.": "output_norm.",
        "embeddings.LayerNorm.": "embeddings_norm.",
    }
    fused_weights: tuple[str, ...] = ("query", "key", "value")
    ignored_prefixes: tuple[str, ...] = ("pooler.", "cls.")  # the NSP pooler and MLM head: unused
    ignored_suffixes: tuple[str, ...] = ("position_ids",)

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        raw = cfg.raw
        eps = float(raw.get("layer_norm_eps", 1e-12))
        act = raw.get("hidden_act", "gelu")
        if act != "gelu":
            raise ModelLoadError(f"{cfg.architecture} with hidden_act {act!r} is not supported (only 'gelu').")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{cfg.architecture}: only absolute position embeddings are supported.")
        hidden = cfg.hidden_size
        self.word_embeddings = Embedding(cfg.vocab_size, hidden, cfg.dtype)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, hidden, cfg.dtype)
        self.token_type_embeddings = Embedding(int(raw.get("type_vocab_size", 2)), hidden, cfg.dtype)
        self.embeddings_norm = LayerNorm(hidden, eps, cfg.dtype)
        self.layers = nn.ModuleList(BertLayer(cfg, eps) for _ in range(cfg.num_hidden_layers))

    @staticmethod
    def position_offset(cfg: ModelConfig) -> int:
        """Where a sequence's position ids start in the position-embedding table."""
        return 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend, meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's hidden states of every token ([T, hidden]); `kv_caches` and `backend` are
        unused (the runner's interface): each sequence is all in this step. No `token_type_ids`: all 0."""
        offset = self.position_offset(self.config)
        if token_type_ids is None or not self.uses_token_types:
            types = self.token_type_embeddings.weight[0]
        else:
            types = self.token_type_embeddings(token_type_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + offset if offset else positions) + types
        x = self.embeddings_norm(x)
        layout = PackedLayout(meta.query_start_loc_host, x.device)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("BertModel is an encoder: it has no language-model head.")

    # ---- weight loading -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix(self.weight_prefix)
            if name.startswith(self.ignored_prefixes) or name.endswith(self.ignored_suffixes):
                continue
            target_name, shard = self._locate(name)
            if target_name not in params:
                raise ModelLoadError(f"Checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}.")
            target = params[target_name].data
            if shard is not None:
                size = target.shape[0] // 3
                target = target.narrow(0, shard * size, size)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"Checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}."
                )
            target.copy_(tensor)
            loaded.add(target_name if shard is None else f"{target_name}#{shard}")
        expected = {
            f"{name}#{shard}" if ".qkv." in name else name for name in params for shard in range(3)
        }
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"The checkpoint lacks {len(missing)} weight(s): {shown}")

    def _locate(self, name: str) -> tuple[str, int | None]:
        """Our parameter for a checkpoint name (embeddings.* and encoder.layer.N.*), and the q/k/v shard."""
        name = name.removeprefix("embeddings.") if name.startswith("embeddings.") and "LayerNorm" not in name else name
        name = name.replace("encoder.layer.", "layers.")
        for fragment, ours in self.renamed_weights.items():
            if fragment in name:
                return name.replace(fragment, ours), None
        for shard, part in enumerate(self.fused_weights):
            fragment = f"attention.self.{part}."
            if fragment in name:
                return name.replace(fragment, "qkv."), shard
        return name, None


class ClassificationHead(nn.Module):
    """transformers' sequence-classification head on the first token: a dense layer, tanh, then the label
    logits (BERT's pooler and classifier, RoBERTa's classifier.dense and out_proj: the same computation)."""

    def __init__(self, hidden: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden, True, dtype)
        self.out = Linear(hidden, num_labels, True, dtype)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_tokens)))


class BertForSequenceClassification(nn.Module):
    """The encoder and its classification head: `forward` gives the hidden states as the encoder does, and
    `classify` turns each sequence's first-token state into its label logits."""

    is_encoder = True
    encoder_class: type[BertModel] = BertModel
    uses_token_types = True  # as its encoder's: the runner passes a pair's token types
    # checkpoint name prefix -> the head's parameter prefix
    head_weights: dict[str, str] = {"bert.pooler.dense.": "dense.", "classifier.": "out."}

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = self.encoder_class(cfg)
        self.head = ClassificationHead(cfg.hidden_size, cfg.num_labels, cfg.dtype)

    @classmethod
    def position_offset(cls, cfg: ModelConfig) -> int:
        return cls.encoder_class.position_offset(cfg)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend, meta: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.encoder(input_ids, positions, kv_caches, backend, meta, token_type_ids)

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, num_labels] float32 logits from each sequence's first-token hidden state ([rows, hidden])."""
        return self.head(first_tokens.to(self.head.dense.weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is an encoder: it has no language-model head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's tensors here, the rest to the encoder."""
        params = dict(self.head.named_parameters())
        loaded: set[str] = set()

        def encoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                prefix = next((p for p in self.head_weights if hf_name.startswith(p)), None)
                if prefix is None:
                    yield hf_name, tensor
                    continue
                name = self.head_weights[prefix] + hf_name.removeprefix(prefix)
                if name not in params or params[name].shape != tensor.shape:
                    raise ModelLoadError(f"Checkpoint tensor {hf_name!r} ({tuple(tensor.shape)}) does not fit the "
                                         f"classification head of {type(self).__name__}.")
                params[name].data.copy_(tensor)
                loaded.add(name)

        self.encoder.load_weights(encoder_weights())
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"The checkpoint lacks the classification head's weight(s): {', '.join(missing)}")
