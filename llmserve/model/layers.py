"""Building blocks shared by the decoder architectures: norms, rotary embeddings, linear layers.

Linear layers on CUDA run a single row (batch-1 decode; every quantized layer up to 16 rows) through
`triton_linear`, which streams the weights faster than cuBLAS there, and everything else through
F.linear (`LLMSERVE_CUDA_LINEAR` = auto | triton | torch); on CPU through `cpu_linear`.

On CUDA the norms (with the residual add), rotary embedding and SiLU-and-multiply run as fused Triton
kernels (`fused_kernels`) when triton is installed (for one row, SiLU-and-multiply runs inside the gate/up
projection's own launch: `Linear.swiglu`, and with LLMSERVE_FOLD_NORMS=1 a row's RMSNorm in the next
projection's: `Linear.after_norm`); on CPU, for decode-sized bf16 batches, as C kernels
(`cpu_fused`); elsewhere, and when LLMSERVE_FUSED_KERNELS=0, they run as the plain torch code below, whose
numerics the kernels reproduce.
"""

from __future__ import annotations

import logging
import math
import os
from types import ModuleType

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model import cpu_fused, cpu_linear
from llmserve.model.config import RopeConfig

logger = logging.getLogger(__name__)

FUSED_KERNELS_ENV = "LLMSERVE_FUSED_KERNELS"


def _fused_setting_from_env() -> bool | None:
    value = os.environ.get(FUSED_KERNELS_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{FUSED_KERNELS_ENV} must be auto, 1 or 0 (got {value!r})")


# None: fused kernels on CUDA tensors when triton imports, and the C ones on decode-sized CPU bf16 tensors;
# True: the Triton ones always (CPU tensors need TRITON_INTERPRET=1, for tests); False: never. Read once at import; tests set it directly.
use_fused_kernels: bool | None = _fused_setting_from_env()
_fused_module: ModuleType | None = None
_fused_import_failed = False


def fused_kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The `fused_kernels` (or, on CPU, `cpu_fused`) module when a fused path should run on x, else None
    (the torch path)."""
    setting = use_fused_kernels
    if setting is False:
        return None
    if setting is None and not x.is_cuda:
        return cpu_fused if cpu_fused.fits(x) else None
    kernels = _import_fused_kernels()
    if kernels is None:
        if setting:
            raise RuntimeError(f"{FUSED_KERNELS_ENV}=1 forces the fused kernels, but triton does not import")
        return None
    if not kernels.available(x):
        raise RuntimeError(
            f"{FUSED_KERNELS_ENV}=1 forces the fused kernels on {x.device.type} tensors, which needs CUDA "
            "or TRITON_INTERPRET=1 (set before the kernels are first used)"
        )
    return kernels


def _import_fused_kernels() -> ModuleType | None:
    # Imported on first use, not with this module: TRITON_INTERPRET is read when the kernels are defined.
    global _fused_module, _fused_import_failed
    if _fused_module is None and not _fused_import_failed:
        try:
            from llmserve.model import fused_kernels
        except ImportError as exc:
            _fused_import_failed = True
            logger.warning("fused kernels are off: %s; the GPU path runs unfused torch ops", exc)
            return None
        _fused_module = fused_kernels
    return _fused_module


# Decode-sized linears on CUDA: "auto" (the default) runs those that `triton_linear` streams faster than the
# library kernels through it, "triton" sends every one that fits there, "torch" none (F.linear, and for
# quantized weights their library paths). Read once at import; benchmarks set it directly.
CUDA_LINEAR_ENV = "LLMSERVE_CUDA_LINEAR"
CUDA_LINEAR_CHOICES = ("auto", "triton", "torch")


def _cuda_linear_path_from_env() -> str:
    path = os.environ.get(CUDA_LINEAR_ENV, "auto").strip().lower() or "auto"
    if path not in CUDA_LINEAR_CHOICES:
        raise ValueError(f"{CUDA_LINEAR_ENV} must be one of {', '.join(CUDA_LINEAR_CHOICES)} (got {path!r})")
    return path


cuda_linear_path: str = _cuda_linear_path_from_env()  # read once, at import
_triton_linear: ModuleType | None = None
_triton_linear_failed = False

# Whether a decode row's RMSNorm runs inside the next projection's launch (`Linear.after_norm`), one launch less
# a norm. Off until a GPU has timed it (BENCHMARKS.md, issue 18). Read once at import; benchmarks set it directly.
FOLD_NORMS_ENV = "LLMSERVE_FOLD_NORMS"
fold_norms: bool = os.environ.get(FOLD_NORMS_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def triton_linear_for(x: torch.Tensor, weight: torch.Tensor, quantized: bool) -> ModuleType | None:
    """The `triton_linear` module when x [M, K] on CUDA should run through it, else None. "auto" takes it
    for quantized weights (the library has no weight-only int8/fp8 product) and for single rows."""
    global _triton_linear, _triton_linear_failed
    if not x.is_cuda or cuda_linear_path == "torch" or _triton_linear_failed:
        return None
    if cuda_linear_path == "auto" and not quantized and x.shape[0] != 1:
        return None
    if _triton_linear is None:
        try:
            from llmserve.model import triton_linear
        except ImportError as exc:
            _triton_linear_failed = True
            logger.warning("triton_linear is off: %s; CUDA linears run the library kernels", exc)
            return None
        _triton_linear = triton_linear
    return _triton_linear if _triton_linear.fits(x, weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) over [..., K] inputs, through the fastest kernel this device has for it."""
    if x.is_cuda:
        x2 = x.reshape(-1, x.shape[-1])
        kernels = triton_linear_for(x2, weight, quantized=False)
        if kernels is not None:
            return kernels.linear(x2, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0])
    return cpu_linear.linear(x, weight, bias)


class VisionLinear(nn.Linear):
    """A vision tower's linear layer: torch's (initialised as torch does, so a built-in checkpoint can draw its
    tower's weights from the module) computed by `linear`, which runs bf16 products in float32 blocks on CPUs
    without bf16 GEMM instructions, where torch's own bf16 GEMM is several times slower."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Linear(nn.Module):
    """A linear layer whose weights come from a checkpoint, so nothing is initialised at construction.
    Decode-sized bf16 batches on CPU run through `cpu_linear`'s kernel. A quantized layer
    (`llmserve.model.quantization`) holds int8/fp8 weights and a `quant_method` that runs its forward pass. With
    LoRA adapters served (`llmserve.model.lora`), `lora` adds the step's adapters to its output."""

    quant_method = None
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x) if self.quant_method is not None else linear(x, self.weight, self.bias)
        if self.lora is not None and self.lora.active:
            return self.lora.add_to(out, x)
        return out

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x through this fused gate/up projection. One row on a GPU runs it in the
        projection's own launch (`triton_linear`), saving a launch a layer; otherwise the projection, then
        `silu_and_mul` (also with LLMSERVE_FUSED_KERNELS=0). The bits are the same either way."""
        x2 = x.reshape(-1, x.shape[-1])
        one_row = self._one_row_kernel(x2)
        if one_row is not None:
            kernels, scale = one_row
            return kernels.linear(x2, self.weight, scale, self.bias, swiglu=True).reshape(*x.shape[:-1], -1)
        return silu_and_mul(self(x))

    def after_norm(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None, swiglu: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this projection of norm(x + residual), the residual stream x + residual); with `swiglu`, silu(gate) *
        up of it (`swiglu`). Without a residual, x is the stream. Where norms are folded (LLMSERVE_FOLD_NORMS=1),
        one row on a GPU runs the norm inside the projection's launch (`triton_linear.normed_linear`)."""
        one_row = self._one_row_kernel(x.reshape(-1, x.shape[-1])) if fold_norms else None
        if one_row is None:
            hidden, residual = (norm(x), x) if residual is None else norm(x, residual)
            return (self.swiglu(hidden) if swiglu else self(hidden)), residual
        kernels, scale = one_row
        folded = kernels.FoldedNorm(norm.weight, norm.eps, None if residual is None else residual.reshape(1, -1))
        out, stream = kernels.normed_linear(x.reshape(1, -1), folded, self.weight, scale, self.bias, swiglu=swiglu)
        return out.reshape(*x.shape[:-1], -1), stream.reshape(x.shape)

    def _one_row_kernel(self, x2: torch.Tensor) -> tuple[ModuleType, torch.Tensor | None] | None:
        """(`triton_linear`, this layer's row scales) when x2, one row, runs there with the fused kernels on."""
        quantized = self.quant_method is not None
        scale = self.quant_method.triton_scale(self) if quantized else None
        adapted = self.lora is not None and self.lora.active
        if x2.shape[0] != 1 or (quantized and scale is None) or use_fused_kernels is False or adapted:
            return None
        kernels = triton_linear_for(x2, self.weight, quantized)
        return None if kernels is None else (kernels, scale)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, the residual stream's add first: (norm(x + residual), x + residual)."""
        kernels = fused_kernels_for(x)
        if residual is None:
            return self._norm(x) if kernels is None else kernels.rms_norm(x, self.weight, self.eps)
        if kernels is not None:
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the scale, as the reference implementation does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings or 8192
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout used by Llama, Qwen and Mistral checkpoints."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). On the fused path q and k are rotated in place (callers pass fresh projections)."""
        kernels = fused_kernels_for(q)
        if kernels is not None:
            return kernels.apply_rotary(positions, q, k, self.cos_cache, self.sin_cache, inplace=True)
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): each token has three position ids (temporal, height,
    width), and the head's frequencies are cut in `section`s that turn with one id each. A text token's three ids
    are equal, so it reads the table as any rotary embedding; an image token's are not: the runner writes those
    tokens' rows past the table (`place`) and points them there, so every attention backend reads them as it reads
    the table, with no position layout of its own."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__(head_dim, max_positions, rope)
        assert rope.mrope_section is not None
        if sum(rope.mrope_section) != head_dim // 2:
            raise ModelLoadError(f"mrope_section {list(rope.mrope_section)} turns {sum(rope.mrope_section)} "
                                 f"frequencies; the heads have {head_dim // 2}.")
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, rope), persistent=False)
        # Which of the three ids turns each frequency.
        axis = torch.repeat_interleave(torch.arange(len(rope.mrope_section)), torch.tensor(rope.mrope_section))
        self.register_buffer("axis", axis % 3, persistent=False)
        self.num_positions = max_positions
        self.image_rows = 0

    def reserve(self, rows: int) -> None:
        """Room for `rows` image tokens in a step. Called before anything reads the table's address (the one-call
        CPU decoder, CUDA graphs): it moves the table."""
        if rows <= self.image_rows:
            return
        extra = rows - self.image_rows
        for name in ("cos_cache", "sin_cache"):
            table = getattr(self, name)
            setattr(self, name, torch.cat([table, table.new_zeros(extra, table.shape[1])]))
        self.image_rows = rows

    def place(self, ids: torch.Tensor) -> int:
        """Write the rows of image tokens with position ids `ids` ([n, 3]: temporal, height, width) past the table,
        in order; the position that reads the first."""
        count = ids.shape[0]
        if count > self.image_rows:
            raise RuntimeError(f"a step places {count} image tokens; the rotary table has room for {self.image_rows}")
        freqs = ids.to(self.inv_freq.device, torch.float32)[:, :, None] * self.inv_freq  # [n, 3, D/2]
        freqs = freqs.gather(1, self.axis.expand(count, 1, -1)).squeeze(1)
        self.cos_cache[self.num_positions : self.num_positions + count] = freqs.cos()
        self.sin_cache[self.num_positions : self.num_positions + count] = freqs.sin()
        return self.num_positions


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up [T, 2I] holds the gate projection's outputs then the up projection's."""
    kernels = fused_kernels_for(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return nn.functional.silu(gate) * up
