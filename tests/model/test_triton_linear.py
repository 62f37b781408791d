"""`triton_linear` (decode-sized linears on CUDA: bf16, int8 and e4m3 weights) against the float64 product of
the weights it was given: in Triton's interpreter on CPU without CUDA (float32), natively in bfloat16 with it;
compiled for an sm_90 GPU without one; and which layers take it on a GPU."""

from __future__ import annotations

import os
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module imports triton

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.model import layers  # noqa: E402
from llmserve.model.quantization.fp8 import quantize_fp8  # noqa: E402
from llmserve.model.quantization.int8 import quantize_int8  # noqa: E402
from llmserve.model.triton_linear import (  # noqa: E402
    _SHAPE_CONFIGS,
    MAX_ROWS,
    FoldedNorm,
    TileConfig,
    config_for,
    linear,
    normed_linear,
)
from tests.model.triton_aot import assert_compiles_for_sm90  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _weights(kind: str, out_features: int, in_features: int, gen: torch.Generator):
    """(weight as the kernel takes it, float32 scale or None, the float64 matrix it stands for)."""
    full = torch.randn(out_features, in_features, generator=gen) * 0.05
    if kind == "full":
        w = full.to(DTYPE)
        return w, None, w.double()
    q, scale = quantize_int8(full) if kind == "int8" else quantize_fp8(full)
    return q, scale, q.double() * scale.double()[:, None]


@pytest.mark.parametrize("kind", ["full", "int8", "fp8"])
@pytest.mark.parametrize(("out_features", "in_features"), [(256, 128), (130, 200), (7, 1040)])
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
def test_linear_matches_the_product_of_its_weights(kind, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + len(kind))
    w, scale, matrix = _weights(kind, out_features, in_features, gen)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None
    x = torch.randn(rows, in_features, generator=gen)
    expected = x.to(DTYPE).double() @ matrix.T + (0 if bias is None else bias.to(DTYPE).double())
    out = linear(x.to(DEVICE, DTYPE), w.to(DEVICE), None if scale is None else scale.to(DEVICE),
                 None if bias is None else bias.to(DEVICE, DTYPE))
    assert out.dtype == DTYPE and out.shape == (rows, out_features)
    tol = (1e-2 if CUDA else 1e-5) * expected.abs().max().item()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("config", [TileConfig(4, 256, 4), TileConfig(32, 64, 8, 3), TileConfig(4, 64, 4, 1, 3, 8),
                                    TileConfig(2, 128, 4, 1, 2, 16), TileConfig(4, 64, 4, split_k=3),
                                    TileConfig(8, 32, 4, 1, 2, 8, split_k=4), TileConfig(4, 256, 4, split_k=2),
                                    *dict.fromkeys(_SHAPE_CONFIGS.values())])
def test_every_tile_shape_computes_the_same_product(kind, config):
    """Tiles that do not divide N or K, slices loaded ahead (`unroll`) past K's end, other load widths, and K
    split into runs (one of them empty where the runs round up past K) give the same result: the benchmark's
    sweep overrides and the tuned shapes' tiles. A split layer's second call finds its arrival counts reset."""
    gen = torch.Generator().manual_seed(7)
    w, scale, matrix = _weights(kind, 100, 300, gen)
    for rows in (1, 3, 1) if config.split_k > 1 else (1, 3):
        x = torch.randn(rows, 300, generator=gen)
        expected = x.to(DTYPE).double() @ matrix.T
        out = linear(x.to(DEVICE, DTYPE), w.to(DEVICE), scale.to(DEVICE), None, config)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=0,
                                   atol=(1e-2 if CUDA else 1e-5) * expected.abs().max().item())


@pytest.mark.parametrize("kind", ["full", "int8", "fp8"])
@pytest.mark.parametrize("config", [None, TileConfig(2, 128, 4), TileConfig(16, 64, 4, 1, 2, 8),
                                    TileConfig(4, 32, 4, split_k=2)])
def test_swiglu_gives_the_bits_of_the_projection_then_silu_and_mul(kind, config):
    """The fused gate/up projection's epilogue (one row) against the projection stored, then the SiLU kernel:
    the same bits, with half-widths that the tiles do not divide."""
    from llmserve.model import fused_kernels

    gen = torch.Generator().manual_seed(len(kind) + (config.block_n if config else 0))
    w, scale, _ = _weights(kind, 2 * 37, 96, gen)
    x = torch.randn(1, 96, generator=gen).to(DEVICE, DTYPE)
    w, scale = w.to(DEVICE), None if scale is None else scale.to(DEVICE)
    for bias in (None, torch.randn(2 * 37, generator=gen).to(DEVICE, DTYPE)):
        fused = linear(x, w, scale, bias, config, swiglu=True)
        assert fused.shape == (1, 37)
        assert torch.equal(fused, fused_kernels.silu_and_mul(linear(x, w, scale, bias, config)))
    with pytest.raises(ValueError, match="one row of x"):
        linear(x.expand(2, -1), w, scale, None, config, swiglu=True)


def test_a_gate_up_layer_fuses_silu_into_its_one_row_launch(monkeypatch):
    """Linear.swiglu: one row takes triton_linear's fused launch (the bits of the projection, then the SiLU
    kernel), two rows the projection, then silu_and_mul."""
    from torch import nn

    from llmserve.model import fused_kernels, triton_linear

    gen = torch.Generator().manual_seed(11)
    layer = layers.Linear(96, 74, True, DTYPE)
    layer.weight = nn.Parameter((torch.randn(74, 96, generator=gen) * 0.05).to(DEVICE, DTYPE), requires_grad=False)
    layer.bias = nn.Parameter(torch.randn(74, generator=gen).to(DEVICE, DTYPE), requires_grad=False)
    launches = []
    original = triton_linear.linear
    monkeypatch.setattr(triton_linear, "linear", lambda *a, **k: launches.append(k.get("swiglu")) or original(*a, **k))
    monkeypatch.setattr(layers, "triton_linear_for", lambda x, w, quantized: triton_linear)  # CPU tensors too
    x = torch.randn(2, 96, generator=gen).to(DEVICE, DTYPE)
    monkeypatch.setattr(layers, "use_fused_kernels", False)
    assert torch.equal(layer.swiglu(x[:1]), layers.silu_and_mul(layer(x[:1])))
    assert True not in launches  # on CUDA the plain projection is triton_linear's too, unfused
    monkeypatch.setattr(layers, "use_fused_kernels", None)
    launches.clear()
    one = layer.swiglu(x[:1])
    assert launches == [True] and one.shape == (1, 37)
    assert torch.equal(one, fused_kernels.silu_and_mul(original(x[:1], layer.weight, None, layer.bias)))
    two = layer.swiglu(x)
    assert True not in launches[1:] and two.shape == (2, 37)
    assert torch.equal(two, layers.silu_and_mul(layer(x)))


def _norm_then_linear(x, norm: FoldedNorm, w, scale, bias, config, swiglu):
    """The unfolded path: the norm kernel (with the residual's add), then the projection's own launch."""
    from llmserve.model import fused_kernels

    if norm.residual is None:
        hidden, stream = fused_kernels.rms_norm(x, norm.weight, norm.eps), x
    else:
        hidden, stream = fused_kernels.fused_add_rms_norm(x, norm.residual, norm.weight, norm.eps)
    return linear(hidden, w, scale, bias, config, swiglu=swiglu), stream


@pytest.mark.parametrize("kind", ["full", "int8", "fp8"])
@pytest.mark.parametrize("config", [None, TileConfig(16, 128, 8, 1, 3, 8), TileConfig(8, 64, 4, split_k=3)])
@pytest.mark.parametrize(("with_residual", "swiglu"), [(True, False), (False, True)])
def test_normed_linear_gives_the_norm_kernel_then_the_projection(kind, config, with_residual, swiglu):
    """RMSNorm folded into the one-row launch (`normed_linear`): the new residual stream bit for bit, and the
    product of the norm kernel's output to rounding (only the mean square's summation order differs), with K
    and N that the tiles do not divide and several slices along K."""
    gen = torch.Generator().manual_seed(len(kind) + 10 * with_residual + 100 * swiglu)
    w, scale, _ = _weights(kind, 2 * 45, 300, gen)
    w, scale = w.to(DEVICE), None if scale is None else scale.to(DEVICE)
    x = (torch.randn(1, 300, generator=gen) * 3).to(DEVICE, DTYPE)
    residual = (torch.randn(1, 300, generator=gen) * 3).to(DEVICE, DTYPE) if with_residual else None
    norm = FoldedNorm((torch.randn(300, generator=gen) * 0.2 + 1).to(DEVICE, DTYPE), 1e-5, residual)
    bias = torch.randn(2 * 45, generator=gen).to(DEVICE, DTYPE)
    out, stream = normed_linear(x, norm, w, scale, bias, config, swiglu=swiglu)
    expected, expected_stream = _norm_then_linear(x, norm, w, scale, bias, config, swiglu)
    assert out.shape == expected.shape == (1, 45 if swiglu else 90)
    assert torch.equal(stream, expected_stream) and (residual is not None or stream is x)
    torch.testing.assert_close(out, expected, rtol=0, atol=(2e-2 if CUDA else 1e-5) * expected.abs().max().item())


@pytest.mark.skipif(CUDA, reason="the interpreter's float16; bfloat16 is checked natively")
def test_folded_norm_rounds_as_the_norm_kernel_in_float16():
    """float16 (which the interpreter rounds as a GPU does): the folded norm's roundings are the norm kernel's,
    so nearly every output is bit-identical (an odd one moves with the mean square's summation order)."""
    gen = torch.Generator().manual_seed(5)
    w, scale, _ = _weights("fp8", 512, 1040, gen)
    x, residual = (torch.randn(2, 1040, generator=gen) * 4).to(torch.float16).chunk(2)
    norm = FoldedNorm((torch.randn(1040, generator=gen) * 0.2 + 1).to(torch.float16), 1e-6, residual)
    out, stream = normed_linear(x, norm, w, scale, None, TileConfig(8, 256, 4))
    expected, expected_stream = _norm_then_linear(x, norm, w, scale, None, TileConfig(8, 256, 4), False)
    assert torch.equal(stream, expected_stream)
    assert (out == expected).float().mean().item() >= 0.99


def test_normed_linear_takes_one_row():
    w = torch.zeros(8, 16, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="one row of x"):
        normed_linear(torch.zeros(2, 16, dtype=DTYPE, device=DEVICE), FoldedNorm(w[0], 1e-6, None), w)


def test_decode_with_every_fold_gives_the_same_tokens(tiny_llama_dir, monkeypatch):
    """The tiny Llama on the Triton attention backend, every one-row projection in `triton_linear` (the
    interpreter), its norms folded into the qkv and gate/up launches and each decode step's rotary and KV write
    into the decode launch (LLMSERVE_FOLD_NORMS, LLMSERVE_FOLD_ROTARY): the greedy tokens of the unfused path,
    and in a decode step no norm launch but the final one and no rotary + KV write launch."""
    from llmserve import LLM, SamplingParams
    from llmserve.model import fused_kernels, triton_linear
    from llmserve.model.attention import triton_backend

    def greedy(llm):
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        return llm.generate(["The quick brown fox"], params)[0].outputs[0].token_ids

    monkeypatch.setattr(triton_backend, "fold_rotary", True)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=64, enable_prefix_caching=False,
              attention_backend="triton")
    monkeypatch.setattr(layers, "use_fused_kernels", False)  # the torch norms and rotary, the KV write kernel
    expected = greedy(llm)
    calls: dict[str, int] = {}
    backend = llm.engine.core.runner.attn_backend
    for owner, name in ((fused_kernels, "fused_add_rms_norm"), (fused_kernels, "rms_norm"),
                        (triton_linear, "normed_linear"), (backend, "_rotate_and_write_kv")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name, **k: calls.update({_n: calls.get(_n, 0) + 1})
                            or _f(*a, **k))
    monkeypatch.setattr(layers, "use_fused_kernels", True)
    monkeypatch.setattr(layers, "fold_norms", True)
    monkeypatch.setattr(layers, "triton_linear_for", lambda x, w, quantized: triton_linear)  # CPU tensors too
    assert greedy(llm) == expected
    layers_count = len(llm.engine.core.runner.model.layers)
    decode_steps = 2  # the prompt's step runs many rows and prefill, which fold neither
    assert calls["normed_linear"] == 2 * layers_count * decode_steps
    assert calls["fused_add_rms_norm"] + calls["rms_norm"] == 2 * layers_count + 1 + decode_steps  # + final norms
    assert calls["_rotate_and_write_kv"] == layers_count  # the prompt's only


def test_a_tuned_shape_takes_its_tiles_at_one_row_only():
    (kind, n, k), tuned = next(iter(_SHAPE_CONFIGS.items()))
    weight = torch.empty(n, k, dtype=torch.int8 if kind == "int8" else torch.float8_e4m3fn, device="meta")
    other = torch.empty(n + 16, k, dtype=weight.dtype, device="meta")
    assert config_for(weight, 1) == tuned
    assert config_for(weight, 2) == config_for(other, 2) and config_for(other, 1) != tuned


def test_a_strided_row_is_read_as_contiguous():
    gen = torch.Generator().manual_seed(3)
    w, _, matrix = _weights("full", 64, 96, gen)
    x = torch.randn(2, 192, generator=gen)[:, ::2]
    out = linear(x.to(DEVICE, DTYPE), w.to(DEVICE))
    expected = x.to(DTYPE).double() @ matrix.T
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=(1e-2 if CUDA else 1e-5) * expected.abs().max().item())


_AOT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.model.triton_linear import _CONFIGS, _SHAPE_CONFIGS, TileConfig, gemv_kernel, small_m_kernel
    from tests.model.triton_aot import assert_pdl_order

    loaded_ahead = [(("fp8", True), TileConfig(4, 1024, 4, 1, 2, 8)), (("int8", True), TileConfig(2, 2048, 4, 1, 4, 8)),
                    (("fp8", True), TileConfig(8, 1024, 4, split_k=2)), (("16-bit", True), TileConfig(4, 1024, 4, split_k=4))]
    tuned = [((kind, True), config) for (kind, _, _), config in _SHAPE_CONFIGS.items()]
    for (kind, one_row), config in [*_CONFIGS.items(), *loaded_ahead, *tuned]:
        fn = gemv_kernel if one_row else small_m_kernel
        for weight in {"16-bit": ("bf16", "fp16"), "int8": ("i8",), "fp8": ("fp8e4nv",)}[kind]:
            act = "fp16" if weight == "fp16" else "bf16"
            ptrs = {"x_ptr": "*" + act, "w_ptr": "*" + weight, "scale_ptr": "*fp32", "bias_ptr": "*" + act,
                    "out_ptr": "*" + act}
            for use_pdl in (False, True):
                consts = dict(HAS_SCALE=kind != "16-bit", HAS_BIAS=True, BLOCK_N=config.block_n,
                              BLOCK_K=config.block_k, PDL=use_pdl)
                if one_row:  # both ways: SwiGLU and the folded norm with PDL, neither without
                    consts.update(UNROLL=config.unroll, VECTOR=config.vector, SWIGLU=use_pdl, NORM=use_pdl,
                                  HAS_RESIDUAL=use_pdl, SPLIT_K=config.split_k)
                    ptrs.update(norm_w_ptr="*" + act, residual_ptr="*" + act, residual_out_ptr="*" + act, eps="fp32",
                                partial_ptr="*fp32", arrived_ptr="*i32")
                sig = {name: ptrs.get(name, "constexpr" if name in consts else "i32") for name in fn.arg_names}
                attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
                ptx = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=config.num_warps, num_stages=config.num_stages)).asm["ptx"]
                assert_pdl_order(ptx, use_pdl, fn.__name__)
                # a 16-bit multiply-add would skip a rounding of the norm's (or the SwiGLU's) that the torch code stores
                opcodes = [line.split()[0] for line in ptx.splitlines() if line.strip()]
                assert not [op for op in opcodes if op.startswith("fma.") and "f16" in op], (kind, config)
    print("compiled")
""")


def test_kernels_compile_for_a_cuda_gpu():
    assert_compiles_for_sm90(_AOT)


@pytest.mark.parametrize(("value", "expected"), [("", "auto"), ("TORCH", "torch"), ("triton", "triton"), ("cublas", None)])
def test_the_environment_variable_sets_the_path(monkeypatch, value, expected):
    """What the module reads once, at import, into `layers.cuda_linear_path`."""
    monkeypatch.setenv(layers.CUDA_LINEAR_ENV, value)
    if expected is None:
        with pytest.raises(ValueError, match="LLMSERVE_CUDA_LINEAR must be one of auto, triton, torch"):
            layers._cuda_linear_path_from_env()
    else:
        assert layers._cuda_linear_path_from_env() == expected


def test_cpu_tensors_never_take_it():
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert layers.triton_linear_for(x, torch.randn(32, 64, dtype=torch.bfloat16), quantized=True) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("path", "rows", "quantized", "taken"), [
    ("auto", 1, False, True), ("auto", 2, False, False), ("auto", 8, True, True), ("auto", MAX_ROWS + 1, True, False),
    ("triton", 2, False, True), ("torch", 1, True, False),
])
def test_which_cuda_linears_take_it(monkeypatch, path, rows, quantized, taken):
    monkeypatch.setattr(layers, "cuda_linear_path", path)
    x = torch.randn(rows, 64, dtype=torch.bfloat16, device="cuda")
    assert (layers.triton_linear_for(x, torch.randn(32, 64, device="cuda").bfloat16(), quantized) is not None) is taken
