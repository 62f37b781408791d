"""Small bf16 steps of Llama-family decoders on CPU in one C call: csrc/decode_llama_cpu.c.

A batch-1 decode step streams the weights through `cpu_linear`'s kernel in tens of milliseconds; driving
it from Python, 24 layers of about ten module and kernel calls each, added a quarter to that, and more on
two threads, which share the weights but not the Python. `CpuDecoder` runs the whole forward pass
(embedding to final norm) in one call instead, with the other kernels' code, so its hidden states are the
same bits as `LlamaForCausalLM.forward`'s on the kernel path. Its descriptors (weight and KV cache
pointers, scratch rows) are built once per model; a step fills in its token arrays and makes one call.

The runner takes it for steps of at most `MAX_TOKENS` tokens (decodes, or a short prefill chunk: each
token then attends to its sequence's cache up to its own position, as a decode does) on a bf16 model on
CPU with the torch attention backend (its KV cache in bf16 or int8: `--kv-cache-dtype int8`, new keys and
values quantized as the step writes them) and bf16 weights, or int8 ones (`--quantization int8`: the decoder's
linear layers run `linear_int8_cpu.c`'s kernel), where `cpu_linear`'s kernels run (built with AVX512-BF16 or
AVX2, or another path asked for with `cpu_linear.use_path`, whose choice the step follows). Otherwise, and
with `use_fast_path(False)`, LLMSERVE_CPU_KERNELS=0 or LLMSERVE_FUSED_KERNELS=0, the per-module path runs.

Projections are described to the C code by `LinearWeights` (a format, the weights, optional per-channel
scales and bias), so other weight formats can bring their own kernel for a range of output channels.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from llmserve.model import cpu_fused, cpu_linear, cpu_lora, layers, native
from llmserve.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, cpu_kernels
from llmserve.model.layers import Linear, RMSNorm
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.quantization.int8 import Int8LinearMethod

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "decode_llama_cpu.c"
INCLUDED = [CSRC / "linear_bf16_cpu.c", CSRC / "linear_int8_cpu.c", CSRC / "elementwise_bf16_cpu.c", CSRC / "lora_bf16_cpu.c",
            cpu_kernels.SOURCE]
MAX_TOKENS = 16  # MAX_TOKENS in the C source; a step takes fewer where `cpu_linear.max_rows()` is lower
WEIGHTS_BF16 = 0
WEIGHTS_INT8 = 1  # int8 [n, k] with float32 per-channel scales (`--quantization int8`)

_enabled = True

_ptr = ctypes.c_void_p
_i32 = ctypes.c_int32


def use_fast_path(enabled: bool) -> None:
    """Run later small CPU bf16 steps through the one-call decoder (True) or the per-module path (False)."""
    global _enabled
    _enabled = enabled


class LinearWeights(ctypes.Structure):
    _fields_ = [
        ("format", _i32), ("n", _i32), ("k", _i32), ("weight", _ptr), ("scale", _ptr), ("bias", _ptr),
        ("lora_a", _ptr), ("lora_bt", _ptr), ("lora_width", _i32),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_attention_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv", LinearWeights), ("o", LinearWeights), ("gate_up", LinearWeights), ("down", LinearWeights),
        ("k_cache", _ptr), ("v_cache", _ptr),
    ]


class Decoder(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i32), ("hidden", _i32), ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32),
        ("intermediate", _i32), ("block_size", _i32), ("kv_format", _i32), ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("embed", _ptr), ("final_norm", _ptr), ("cos_cache", _ptr), ("sin_cache", _ptr), ("layers", _ptr),
        ("qkv", _ptr), ("query", _ptr), ("attn", _ptr), ("proj", _ptr),
        ("gate_up", _ptr), ("act", _ptr),
    ]


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("tokens", _i32), ("max_blocks", _i32), ("threads", _i32), ("path", _i32),
        ("input_ids", _ptr), ("positions", _ptr), ("slots", _ptr), ("tables", _ptr), ("lens", _ptr), ("out", _ptr),
        ("lora_slots", _ptr),
    ]


@functools.cache
def load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library, built on first use with the linear kernels' tuning for this CPU; None when it cannot be
    built or kernels are off. `defines` (NAME=VALUE) builds a variant of the tuning constants of the kernels it
    includes, for benchmarks and tests."""
    lib = native.load_library(SOURCE, INCLUDED, defines=cpu_linear.tuned(defines))
    if lib is None:
        return None
    lib.llmserve_decode_step.restype = ctypes.c_int
    lib.llmserve_decode_step.argtypes = [ctypes.POINTER(Decoder), ctypes.POINTER(DecodeStep)]
    return lib


def _kernel_path_active() -> bool:
    """Whether the per-module path would run its small bf16 steps through the C kernels too (not when the
    fused kernels are off, nor when the Triton ones are forced)."""
    return (
        _enabled and layers.use_fused_kernels is None and cpu_linear.bf16_kernel_runs()
    )


def _linear(layer: Linear) -> LinearWeights:
    n, k = layer.weight.shape
    bias = None if layer.bias is None else layer.bias.data_ptr()
    lora = layer.lora  # its LoRA slots: filled in place, so the pointers hold
    adapter = (None, None, 0) if lora is None else (lora.a.data_ptr(), lora.bt.data_ptr(), lora.a.shape[1])
    if layer.weight.dtype == torch.int8:
        return LinearWeights(WEIGHTS_INT8, n, k, layer.weight.data_ptr(), layer.weight_scale.data_ptr(), bias, *adapter)
    return LinearWeights(WEIGHTS_BF16, n, k, layer.weight.data_ptr(), None, bias, *adapter)


def _norm_weight(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


class CpuDecoder:
    """One model's forward pass for steps of at most MAX_TOKENS tokens, through `llmserve_decode_step`."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend,
        lib: ctypes.CDLL,
    ) -> None:
        cfg = model.config
        self._lib = lib
        self._model, self._kv_caches = model, kv_caches  # the descriptors point into them
        self.hidden_size = cfg.hidden_size
        q_size = cfg.num_attention_heads * cfg.head_dim
        qkv_width = q_size + 2 * cfg.num_key_value_heads * cfg.head_dim
        widths = [qkv_width, q_size, q_size, cfg.hidden_size, 2 * cfg.intermediate_size, cfg.intermediate_size]
        self._scratch = [torch.empty(MAX_TOKENS, width, dtype=torch.bfloat16) for width in widths]
        self._layers = (LayerWeights * len(model.layers))(*(
            LayerWeights(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                _norm_weight(layer.self_attn.q_norm), _norm_weight(layer.self_attn.k_norm),
                _linear(layer.self_attn.qkv_proj), _linear(layer.self_attn.o_proj),
                _linear(layer.mlp.gate_up_proj), _linear(layer.mlp.down_proj),
                k_cache.data_ptr(), v_cache.data_ptr(),
            )
            for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True)
        ))
        self._decoder = Decoder(
            len(model.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, backend.block_size,
            cpu_kernels.format_code(torch.bfloat16, backend.kv_cache_dtype), cfg.rms_norm_eps, backend.scale,
            model.embed_tokens.weight.data_ptr(), model.norm.weight.data_ptr(),
            model.rotary.cos_cache.data_ptr(), model.rotary.sin_cache.data_ptr(), ctypes.addressof(self._layers),
            *(buffer.data_ptr() for buffer in self._scratch),
        )
        self.max_lora_width = max((layer.lora.a.shape[1] for layer in model.modules()
                                   if isinstance(layer, Linear) and layer.lora is not None), default=0)
        self._int8 = any(layer.weight.dtype == torch.int8 for layer in model.modules() if isinstance(layer, Linear))
        self._step = DecodeStep()
        self._decoder_ref = ctypes.byref(self._decoder)
        self._step_ref = ctypes.byref(self._step)

    @classmethod
    def build(
        cls, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend
    ) -> CpuDecoder | None:
        """The decoder for this model, or None when it cannot run it (see the module docstring)."""
        if not isinstance(model, LlamaForCausalLM) or not _supports(model, kv_caches, backend):
            return None
        lib = load()
        return None if lib is None else cls(model, kv_caches, backend, lib)

    def max_tokens(self) -> int:
        """The most tokens a step runs here now: MAX_TOKENS, or fewer where the linear kernels take fewer rows
        on the path they run now; 0 while the kernels are off (larger steps take the per-module path)."""
        if not _kernel_path_active() or (self._int8 and not cpu_linear.int8_kernel_runs()):
            return 0
        return min(MAX_TOKENS, cpu_linear.int8_max_rows() if self._int8 else cpu_linear.max_rows())

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here."""
        return 0 < num_tokens <= self.max_tokens()

    def takes_lora(self) -> bool:
        """Whether its steps can add LoRA adapters (their slots are no wider than the C code takes)."""
        return 0 < self.max_lora_width <= cpu_lora.MAX_LORA_WIDTH

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output [T, hidden] for the step's tokens, the new keys and values in the cache.
        `lora_slots` ([T] int32, -1: none): each token's LoRA adapter slot."""
        tokens = input_ids.shape[0]
        if meta.num_decodes == meta.num_seqs:  # one token per sequence: the step's tables and lengths as they are
            tables, lens = meta.block_tables, meta.seq_lens
        else:
            rows = torch.repeat_interleave(meta.query_start_loc.diff())
            tables = meta.block_tables.index_select(0, rows)
            lens = (positions + 1).to(torch.int32)
        _check_index_types(input_ids, positions, meta.slot_mapping, tables, lens)
        out = torch.empty(tokens, self.hidden_size, dtype=torch.bfloat16)
        step = self._step
        step.tokens, step.max_blocks = tokens, tables.shape[1]
        step.threads, step.path = torch.get_num_threads(), cpu_linear.PATHS[cpu_linear.current_path()]
        step.input_ids, step.positions = input_ids.data_ptr(), positions.data_ptr()
        step.slots, step.tables, step.lens = meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr()
        step.out = out.data_ptr()
        if lora_slots is not None and (lora_slots.dtype != torch.int32 or lora_slots.shape != (tokens,)
                                       or not lora_slots.is_contiguous()):
            raise TypeError("the CPU decode step needs one contiguous int32 LoRA slot per token")
        step.lora_slots = None if lora_slots is None else lora_slots.data_ptr()
        if self._lib.llmserve_decode_step(self._decoder_ref, self._step_ref) != 0:
            raise RuntimeError("the CPU decode step rejected its arguments")
        return out


def _check_index_types(*tensors: torch.Tensor) -> None:
    """The C side reads ids, positions and slots as int64, tables and lengths as int32, all contiguous."""
    for tensor, dtype in zip(tensors, (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32), strict=True):
        if tensor.dtype != dtype or not tensor.is_contiguous():
            raise TypeError(f"the CPU decode step needs contiguous {dtype} indices, got {tensor.dtype}")


def _supports(
    model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: AttentionBackend
) -> bool:
    cfg = model.config
    params = list(model.parameters())
    return (
        not getattr(model, "has_experts", False)  # its layers are dense MLPs
        and isinstance(backend, TorchAttentionBackend)
        # a bf16 or int8 cache: the kernel's formats under bf16 queries
        and cpu_kernels.supports(torch.bfloat16, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                 backend.kv_cache_dtype)
        and len(kv_caches) == len(model.layers) > 0
        and all(k.device.type == "cpu" and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
        and all(p.device.type == "cpu" and p.is_contiguous() for p in params)
        and all(_weights_supported(m) for m in model.modules())
        and model.rotary.cos_cache.dtype == torch.float32 and cfg.hidden_size <= cpu_fused.MAX_WIDTH
        and cfg.head_dim % 2 == 0
    )


def _weights_supported(module: nn.Module) -> bool:
    """A module's own parameters in bf16, or a Linear's int8 weights with float32 per-channel scales
    (`--quantization int8`)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return all(p.dtype == torch.bfloat16 for p in module.parameters(recurse=False))
    return (
        isinstance(method, Int8LinearMethod) and module.weight.dtype == torch.int8
        and module.weight_scale.dtype == torch.float32
        and (module.bias is None or module.bias.dtype == torch.bfloat16)
    )
