"""The Triton int8-weight matmul (the CUDA path of `--quantization int8`) against dequantize-then-matmul:
in Triton's interpreter on CPU without CUDA (float32), natively in bfloat16 with it; and compiled for an
sm_90 GPU without one."""

from __future__ import annotations

import os
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module imports triton

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.model.quantization.int8 import quantize_int8  # noqa: E402
from llmserve.model.quantization.triton_int8 import w8a16_matmul  # noqa: E402
from tests.model.triton_aot import assert_compiles_for_sm90  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


@pytest.mark.parametrize(("out_features", "in_features"), [(256, 128), (130, 200), (7, 33)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_w8a16_matmul_matches_dequantize_then_matmul(out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    q, scale = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None
    x = torch.randn(rows, in_features, generator=gen)
    expected = x.double() @ (q.double() * scale.double()[:, None]).T + (0 if bias is None else bias.double())
    out = w8a16_matmul(x.to(DEVICE, DTYPE), q.to(DEVICE), scale.to(DEVICE),
                       None if bias is None else bias.to(DEVICE, DTYPE))
    assert out.dtype == DTYPE and out.shape == (rows, out_features)
    tol = (1e-2 if CUDA else 1e-5) * expected.abs().max().item()
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=tol)


_AOT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.model.quantization.triton_int8 import w8a16_matmul_kernel as fn

    for dtype in ("bf16", "fp16"):
        for block_m, block_n in ((16, 32), (64, 64)):
            ptrs = {"x_ptr": "*" + dtype, "w_ptr": "*i8", "scale_ptr": "*fp32", "bias_ptr": "*" + dtype,
                    "out_ptr": "*" + dtype}
            consts = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64)
            sig = {name: ptrs.get(name, "constexpr" if name in consts else "i32") for name in fn.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
            triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32))
    print("compiled")
""")


def test_kernel_compiles_for_a_cuda_gpu():
    assert_compiles_for_sm90(_AOT)
