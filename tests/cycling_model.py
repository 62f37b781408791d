"""A built-in Llama checkpoint turned into one that repeats cycles of tokens, as repetitive text does (what
speculative decoding's n-gram drafts are for): its lm_head maps each token's embedding to the next token of
its cycle, and its attention and MLP outputs are scaled by 0.1, so the context still moves the logits.

With `agreement` below 1 (a draft model for speculative decoding that is right that often): each token's
successor is its cycle's with that probability, else a random token.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CYCLE = 7


def make_cycling_model(src: Path, dst: Path, cycle: int = CYCLE, agreement: float = 1.0, seed: int = 0) -> Path:
    """Copy the checkpoint in `src` (one or more safetensors shards) to `dst`, changed as the module says."""
    shutil.copytree(src, dst)
    shards = sorted(dst.glob("*.safetensors"))
    tensors = {shard: load_file(shard) for shard in shards}
    home = next(shard for shard, weights in tensors.items() if "model.embed_tokens.weight" in weights)
    for weights in tensors.values():
        weights.pop("lm_head.weight", None)
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * 0.1
            elif name == "model.norm.weight":
                weights[name] = weights[name] * 4
    embed = tensors[home]["model.embed_tokens.weight"]
    ids = torch.arange(embed.shape[0])
    starts = (ids // cycle) * cycle
    lengths = (len(ids) - starts).clamp(max=cycle)  # the last cycle is shorter unless `cycle` divides the vocabulary
    successor = starts + (ids - starts + 1) % lengths  # a permutation of the ids
    if agreement < 1:
        generator = torch.Generator().manual_seed(seed)
        astray = torch.rand(len(ids), generator=generator) >= agreement
        successor[astray] = torch.randint(len(ids), (int(astray.sum()),), generator=generator)
    # each token's row scores the tokens it follows: their embeddings (one each, with every successor kept)
    lm_head = torch.zeros_like(embed, dtype=torch.float32).index_add_(0, successor, embed.float())
    tensors[home]["lm_head.weight"] = lm_head.to(embed.dtype)
    for shard, weights in tensors.items():
        save_file(weights, shard, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        layout = json.loads(index.read_text())
        layout["weight_map"]["lm_head.weight"] = home.name
        index.write_text(json.dumps(layout))
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config))
    return dst
