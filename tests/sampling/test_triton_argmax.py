"""`triton_argmax.argmax_rows` (the greedy choice on CUDA) against torch.argmax: first index of the largest
value, NaN above everything, rows of -inf, vocabularies off the chunk size; in Triton's interpreter on CPU
without CUDA, natively with it, where the sampler's greedy rows take it too."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module imports triton

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.sampling import triton_argmax  # noqa: E402
from llmserve.sampling.params import SamplingParams  # noqa: E402
from llmserve.sampling.sampler import Sampler, SamplingMetadata, SamplingRow  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = triton_argmax.CHUNK


def _rows(vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(7, vocab_size, generator=gen)
    logits[1] = float("-inf")  # every token banned
    logits[2, :] = 0.0
    logits[2, [CHUNK, vocab_size - 1]] = 4.0  # ties across chunks: the first wins
    logits[0, [CHUNK - 1, CHUNK]] = 9.0  # at the edge of two chunks
    logits[3, [vocab_size - 1, 17]] = float("nan")  # NaN wins, the first one
    logits[4, -1] = 100.0  # in the last, partial chunk
    logits[5, : vocab_size // 2] = float("-inf")
    logits[6, CHUNK - 1] = float("inf")
    logits[6, CHUNK] = float("nan")
    return logits


@pytest.mark.parametrize("vocab_size", [1, 100, CHUNK, CHUNK + 1, 3 * CHUNK + 77])
def test_argmax_rows_is_torch_argmax(vocab_size):
    logits = _rows(vocab_size) if vocab_size > CHUNK else torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=1)
    got = triton_argmax.argmax_rows(logits.to(DEVICE))
    assert got.dtype == torch.int64 and got.device.type == DEVICE
    assert got.cpu().tolist() == expected.tolist()


def test_a_strided_batch_and_no_rows():
    logits = _rows(CHUNK + 1)
    wide = torch.zeros(7, 2 * (CHUNK + 1))
    wide[:, ::2] = logits
    assert triton_argmax.argmax_rows(wide[:, ::2].to(DEVICE)).cpu().tolist() == logits.argmax(dim=1).tolist()
    assert triton_argmax.argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_takes_it_for_greedy_rows_on_cuda(monkeypatch):
    logits = _rows(3 * CHUNK + 77)
    taken = []
    original = triton_argmax.argmax_rows
    monkeypatch.setattr(triton_argmax, "argmax_rows", lambda scores: taken.append(scores.shape) or original(scores))
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=i, sample_index=0, prompt_token_ids=(), output_token_ids=())
            for i in range(len(logits))]
    out = Sampler()(logits.cuda(), SamplingMetadata.build(rows, logits.shape[1], device="cuda"))
    assert taken == [logits.shape] and out.token_ids.cpu().tolist() == logits.argmax(dim=1).tolist()


_AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmserve.sampling.triton_argmax import CHUNK, chunk_max_kernel, row_argmax_kernel
from tests.model.triton_aot import assert_pdl_order

for fn, ptrs, consts, warps in (
    (chunk_max_kernel, {"logits_ptr": "*fp32", "values_ptr": "*fp32", "index_ptr": "*i32"}, {"CHUNK": CHUNK}, 4),
    (row_argmax_kernel, {"values_ptr": "*fp32", "index_ptr": "*i32", "out_ptr": "*i64"}, {"BLOCK": 64}, 1),
):
    for pdl in (False, True):
        sig = {name: ptrs.get(name, "constexpr" if name in {**consts, "PDL": pdl} else "i32") for name in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, sig, constexprs={**consts, "PDL": pdl}), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        assert_pdl_order(compiled.asm["ptx"], pdl, fn.__name__)
print("compiled")
"""


def test_kernels_compile_for_a_cuda_gpu():
    from tests.model.triton_aot import assert_compiles_for_sm90

    assert_compiles_for_sm90(_AOT)
