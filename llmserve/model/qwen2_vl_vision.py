"""Qwen2-VL's and Qwen2.5-VL's vision towers (transformers' `Qwen2VisionTransformerPretrainedModel` and
`Qwen2_5_VisionTransformerPretrainedModel`): the image encoders whose output tokens stand in a Qwen-VL prompt.

An image flows through a tower as follows. Its pixels ([3, H, W], as `QwenImageProcessor` prepares them: H and W
multiples of patch_size * spatial_merge_size) are cut into patch_size squares, ordered merge block by merge block
(the spatial_merge_size**2 patches that become one decoder token next to each other, each block's row by row).
Each patch is embedded linearly: the checkpoint's Conv3d over the still image repeated temporal_patch_size times,
which for a stride equal to its kernel is one matmul. Pre-norm transformer blocks follow, with 2D rotary position
embeddings (each patch's row and column) and bidirectional attention: across the whole image (Qwen2-VL), or, in
Qwen2.5-VL, within windows of window_size pixels square but in the blocks of `fullatt_block_indexes`. The merger
normalises each patch and maps each merge block, its patches concatenated, to one token of the decoder's width.
The output is one token per merge block, row by row over the image: [(H / (p*m)) * (W / (p*m)), out_dim].

Parameters carry transformers' names under its vision model, so a checkpoint's `visual.*` (or `model.visual.*`)
tensors load by name with that prefix stripped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from llmserve.errors import ModelLoadError
from llmserve.model.clip import activation
from llmserve.model.layers import VisionLinear, linear

DEFAULT_ROPE_THETA = 10000.0
NORM_EPS = 1e-6

@dataclass(frozen=True)
class TowerSpec:
    """What shapes a Qwen-VL vision tower, in the same words for both generations."""

    width: int  # the ViT's hidden size
    depth: int
    num_heads: int
    intermediate_size: int
    out_dim: int  # the merger's output: the decoder's hidden size
    hidden_act: str
    in_channels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    rope_theta: float
    window_size: int | None  # pixels; None: every block attends across the whole image
    full_attention_blocks: frozenset[int]

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @classmethod
    def qwen2(cls, cfg: dict[str, Any]) -> TowerSpec:
        """From a Qwen2-VL `vision_config`, transformers' defaults filling what it leaves out."""
        width = int(cfg.get("embed_dim", 1280))
        return cls(
            width=width,
            depth=int(cfg.get("depth", 32)),
            num_heads=int(cfg.get("num_heads", 16)),
            intermediate_size=int(width * cfg.get("mlp_ratio", 4)),
            out_dim=int(cfg.get("hidden_size", 3584)),
            hidden_act=cfg.get("hidden_act", "quick_gelu"),
            window_size=None,
            full_attention_blocks=frozenset(),
            **_shared_fields(cfg),
        )

    @classmethod
    def qwen25(cls, cfg: dict[str, Any]) -> TowerSpec:
        """From a Qwen2.5-VL `vision_config`, transformers' defaults filling what it leaves out."""
        return cls(
            width=int(cfg.get("hidden_size", 3584)),
            depth=int(cfg.get("depth", 32)),
            num_heads=int(cfg.get("num_heads", 16)),
            intermediate_size=int(cfg.get("intermediate_size", 3420)),
            out_dim=int(cfg.get("out_hidden_size", 3584)),
            hidden_act=cfg.get("hidden_act", "silu"),
            window_size=int(cfg.get("window_size", 112)),
            full_attention_blocks=frozenset(int(i) for i in cfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
            **_shared_fields(cfg),
        )


def _shared_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or {}
    return {
        # Published configs say in_chans; transformers' config class says in_channels.
        "in_channels": int(cfg.get("in_channels", cfg.get("in_chans", 3))),
        "patch_size": int(cfg.get("patch_size", 14)),
        "merge_size": int(cfg.get("spatial_merge_size", 2)),
        "temporal_patch_size": int(cfg.get("temporal_patch_size", 2)),
        "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))),
    }


class RMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm: normalised in float32, cast back, then scaled (in that order, as transformers)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normalised = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.weight * normalised.to(x.dtype)


class PatchEmbed(nn.Module):
    """Patches of the image, embedded. `proj` is the checkpoint's Conv3d; it only holds the weight, applied as a
    matmul over flattened patches (the same for a kernel that is its own stride)."""

    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.width, kernel, stride=kernel, bias=False, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[patches, width] of [channels, H, W] pixels, patches merge block by merge block."""
        weight = self.proj.weight
        patches = merge_block_patches(pixels.to(device=weight.device, dtype=weight.dtype), self.spec)
        # A still image is every frame of a temporal patch: the same pixels, temporal_patch_size times.
        frames = patches.unsqueeze(2).expand(-1, -1, self.spec.temporal_patch_size, -1, -1)
        return linear(frames.reshape(patches.shape[0], -1), weight.reshape(weight.shape[0], -1))


def merge_block_patches(pixels: torch.Tensor, spec: TowerSpec) -> torch.Tensor:
    """[patches, channels, p, p] squares of [channels, H, W] pixels, in transformers' order: merge blocks row by
    row, and the patches of each block row by row."""
    channels, height, width = pixels.shape
    p, m = spec.patch_size, spec.merge_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"An image of {width}x{height} pixels is not in whole {p * m}-pixel merge blocks.")
    blocks = pixels.reshape(channels, height // (p * m), m, p, width // (p * m), m, p)
    return blocks.permute(1, 4, 2, 5, 0, 3, 6).reshape(-1, channels, p, p)


def patch_positions(rows: int, columns: int, merge_size: int, device: torch.device) -> torch.Tensor:
    """[patches, 2]: (row, column) of each patch of a rows x columns patch grid, in merge-block order."""
    m = merge_size
    row = torch.arange(rows, device=device).view(rows // m, 1, m, 1).expand(-1, columns // m, -1, m)
    column = torch.arange(columns, device=device).view(1, columns // m, 1, m).expand(rows // m, -1, m, -1)
    return torch.stack([row.reshape(-1), column.reshape(-1)], dim=-1)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin), [patches, head_dim]: a quarter of the frequencies turn with the row, a quarter with the
    column, and the two halves of a head repeat that (transformers' axial vision RoPE)."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
    inverse_frequencies = 1.0 / (theta**exponents)
    angles = (positions[..., None].float() * inverse_frequencies).flatten(1)  # rows' angles, then columns'
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([patches, heads, head_dim]) rotated in float32, back in its own dtype."""
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    rotated = wide * cos[:, None] + torch.cat([-second, first], dim=-1) * sin[:, None]
    return rotated.to(x.dtype)


@dataclass(frozen=True)
class Windows:
    """Attention windows of an image, padded to one length: `members` [windows, length] are the patches of each
    (padding: patch 0, masked out by `valid`), and `slot` the place in members.flatten() of each patch."""

    members: torch.Tensor
    valid: torch.Tensor
    slot: torch.Tensor


def attention_windows(rows: int, columns: int, spec: TowerSpec, device: torch.device) -> Windows:
    """Qwen2.5-VL's windows: squares of window_size pixels from the top left corner, cut short at the right and
    bottom edges. Their order does not matter; only which patches attend to which."""
    assert spec.window_size is not None
    m = spec.merge_size
    per_side = spec.window_size // (m * spec.patch_size)  # merge blocks along a window's side
    block_rows, block_columns = rows // m, columns // m
    window_rows, window_columns = -(-block_rows // per_side), -(-block_columns // per_side)
    blocks = torch.arange(block_rows * block_columns, device=device).view(block_rows, block_columns)
    blocks = F.pad(blocks, (0, window_columns * per_side - block_columns, 0, window_rows * per_side - block_rows),
                   value=-1)
    blocks = blocks.view(window_rows, per_side, window_columns, per_side).transpose(1, 2).reshape(-1, per_side**2)
    members = blocks[..., None] * m * m + torch.arange(m * m, device=device)
    valid = (blocks >= 0)[..., None].expand_as(members).reshape(blocks.shape[0], -1)
    members = members.reshape(blocks.shape[0], -1)
    slot = torch.empty(rows * columns, dtype=torch.long, device=device)
    slot[members[valid]] = torch.arange(members.numel(), device=device)[valid.flatten()]
    return Windows(members.masked_fill(~valid, 0), valid, slot)


class VisionAttention(nn.Module):
    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = VisionLinear(spec.width, 3 * spec.width, dtype=dtype)
        self.proj = VisionLinear(spec.width, spec.width, dtype=dtype)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], windows: Windows | None
                ) -> torch.Tensor:
        """Bidirectional attention of x ([patches, width]) across the image, or within each of `windows`."""
        patches, width = x.shape
        q, k, v = self.qkv(x).view(patches, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        if windows is None:  # (a batch of one: torch's fused CPU kernel takes 4-D inputs only)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None])[0]
            return self.proj(out.transpose(0, 1).reshape(patches, width))
        q, k, v = (t[windows.members].transpose(1, 2) for t in (q, k, v))  # [windows, heads, length, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=windows.valid[:, None, None, :])
        return self.proj(out.transpose(1, 2).reshape(-1, width)[windows.slot])


class GeluMlp(nn.Module):
    """Qwen2-VL's MLP: fc1, the activation, fc2."""

    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = VisionLinear(spec.width, spec.intermediate_size, dtype=dtype)
        self.fc2 = VisionLinear(spec.intermediate_size, spec.width, dtype=dtype)
        self.act = activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMlp(nn.Module):
    """Qwen2.5-VL's MLP: SwiGLU, with biases."""

    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = VisionLinear(spec.width, spec.intermediate_size, dtype=dtype)
        self.up_proj = VisionLinear(spec.width, spec.intermediate_size, dtype=dtype)
        self.down_proj = VisionLinear(spec.intermediate_size, spec.width, dtype=dtype)
        self.act = activation(spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, attn: VisionAttention, norm2: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], windows: Windows | None
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, windows)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's patches, normalised and concatenated, mapped to one token of the decoder's width."""

    def __init__(self, ln_q: nn.Module, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        merged = spec.width * spec.merge_size**2
        self.ln_q = ln_q
        self.mlp = nn.Sequential(VisionLinear(merged, merged, dtype=dtype), nn.GELU(),
                                 VisionLinear(merged, spec.out_dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.mlp[0].in_features
        return self.mlp(self.ln_q(x).reshape(-1, merged))


class QwenVisionTower(nn.Module):
    """What both generations share; a subclass picks the norm and the MLP."""

    def __init__(self, spec: TowerSpec, dtype: torch.dtype) -> None:
        super().__init__()
        if spec.width % spec.num_heads or spec.head_dim % 4:
            raise ModelLoadError(f"A vision width of {spec.width} does not split into {spec.num_heads} heads with "
                                 "rotary dimensions for rows and columns.")
        self.spec = spec
        self.out_dim = spec.out_dim
        self.patch_embed = PatchEmbed(spec, dtype)
        self.blocks = nn.ModuleList(
            VisionBlock(self.norm(spec, dtype), VisionAttention(spec, dtype), self.norm(spec, dtype),
                        self.mlp(spec, dtype))
            for _ in range(spec.depth))
        self.merger = PatchMerger(self.norm(spec, dtype), spec, dtype)

    def norm(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def mlp(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tokens, out_dim] of one image's [3, H, W] pixels: a token per merge block, row by row."""
        x = self.patch_embed(pixels)
        rows, columns = pixels.shape[1] // self.spec.patch_size, pixels.shape[2] // self.spec.patch_size
        positions = patch_positions(rows, columns, self.spec.merge_size, x.device)
        rotary = rotary_tables(positions, self.spec.head_dim, self.spec.rope_theta)
        windows = None
        if self.spec.window_size is not None:
            windows = attention_windows(rows, columns, self.spec, x.device)
        for index, block in enumerate(self.blocks):
            x = block(x, rotary, None if index in self.spec.full_attention_blocks else windows)
        return self.merger(x)


class Qwen2VisionTower(QwenVisionTower):
    """Qwen2-VL's tower: LayerNorms, a GELU-family MLP, full attention in every block."""

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__(TowerSpec.qwen2(vision_config), dtype)

    def norm(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        return nn.LayerNorm(spec.width, eps=NORM_EPS, dtype=dtype)

    def mlp(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        return GeluMlp(spec, dtype)


class Qwen25VisionTower(QwenVisionTower):
    """Qwen2.5-VL's tower: RMSNorms, a SwiGLU MLP, window attention but in `fullatt_block_indexes`."""

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__(TowerSpec.qwen25(vision_config), dtype)

    def norm(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(spec.width, dtype)

    def mlp(self, spec: TowerSpec, dtype: torch.dtype) -> nn.Module:
        return GatedMlp(spec, dtype)
