"""The fused Triton kernels (add + RMSNorm, RMSNorm, rotary, SiLU-and-mul) against the torch code of
`layers.py`, and the tiny models with the fused path forced on against it off. Without CUDA the kernels
run in Triton's interpreter on CPU: float32 to rounding, float16 bit for bit (the interpreter rounds
float16 as the GPU does; its bfloat16 casts truncate, so bfloat16 is checked natively by the `gpu`
class). Without a GPU, bfloat16 is checked in two halves: the kernels' rounding order, written as torch
ops, against the torch code on any device, and the kernels compiled for sm_90 (as launched: no FP
fusion) containing no 16-bit multiply-add that would skip one of those roundings."""

from __future__ import annotations

import os
import textwrap
from types import SimpleNamespace

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module imports triton

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.model import fused_kernels, layers  # noqa: E402
from llmserve.model.config import RopeConfig  # noqa: E402
from llmserve.model.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from llmserve.model.runner import StepBatch  # noqa: E402
from tests.model.triton_aot import assert_compiles_for_sm90  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6
FLOAT32_TOL = 2e-5


@pytest.fixture
def fused_off(monkeypatch):
    monkeypatch.setattr(layers, "use_fused_kernels", False)


def _set_fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(layers, "use_fused_kernels", on)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _norm_module(size: int, dtype: torch.dtype, seed: int = 1) -> RMSNorm:
    norm = RMSNorm(size, EPS, dtype).to(DEVICE)
    norm.weight.data.copy_(_rand(size, dtype=dtype, seed=seed) * 0.5 + 1.0)
    return norm


def _assert_rounding_close(out: torch.Tensor, expected: torch.Tensor, min_identical: float) -> None:
    """Same dtype and shape, every element within two units in the last place, and at least
    `min_identical` of them bit-identical (float32 math in another order moves only the odd one)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tol = 2 * torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert (out == expected).float().mean().item() >= min_identical


def _qkv_views(tokens, heads, kv_heads, head_dim, dtype, seed):
    """q [T, H, D] and k, v [T, KVH, D] as strided views of one fused projection output."""
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v


def _positions(tokens: int, limit: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(limit, generator=gen)[:tokens].to(DEVICE)  # out of order, far apart


# ---- the kernels against the torch code ---------------------------------------------------------

NORM_SIZES = [96, 128, 1000]  # not a power of two, a power of two, bigger and odd
TOKENS = [1, 37]


@pytest.mark.parametrize("hidden", NORM_SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_the_torch_norm(hidden, tokens, fused_off):
    norm = _norm_module(hidden, torch.float32)
    x = _rand(tokens, hidden, seed=tokens, scale=3.0)
    out = fused_kernels.rms_norm(x, norm.weight, EPS)
    torch.testing.assert_close(out, norm(x), atol=FLOAT32_TOL, rtol=FLOAT32_TOL)


@pytest.mark.parametrize("hidden", NORM_SIZES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_add_rms_norm_matches_add_then_norm(hidden, tokens, fused_off):
    norm = _norm_module(hidden, torch.float32)
    x, residual = _rand(tokens, hidden, seed=2), _rand(tokens, hidden, seed=3, scale=4.0)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_kernels.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(new_residual, residual_before + x_before)  # the stream itself is exact
    torch.testing.assert_close(out, norm(residual_before + x_before), atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs untouched


def test_fused_add_rms_norm_reads_row_strided_inputs(fused_off):
    norm = _norm_module(96, torch.float32)
    wide = _rand(37, 200, seed=4)
    x, residual = wide[:, :96], wide[:, 100:196]
    out, new_residual = fused_kernels.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(new_residual, residual + x) and new_residual.is_contiguous()
    torch.testing.assert_close(out, norm(residual + x), atol=FLOAT32_TOL, rtol=FLOAT32_TOL)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 128), (5, 1, 80)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_per_head_on_strided_q_and_k_views(heads, kv_heads, head_dim, tokens, fused_off):
    # Qwen3's q/k norms: [T, heads, head_dim] views into the fused qkv projection output
    q_norm, k_norm = _norm_module(head_dim, torch.float32, 5), _norm_module(head_dim, torch.float32, 6)
    qkv, q, k, _ = _qkv_views(tokens, heads, kv_heads, head_dim, torch.float32, seed=tokens)
    qkv_before = qkv.clone()
    for norm, x in ((q_norm, q), (k_norm, k)):
        out = fused_kernels.rms_norm(x, norm.weight, EPS)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, norm(x), atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    assert torch.equal(qkv, qkv_before)


ROTARY_SHAPES = [(4, 2, 64), (5, 1, 80), (32, 8, 128)]  # heads, kv_heads, head_dim (80: half not a power of 2)


def _rotary(head_dim: int, rope: RopeConfig | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, 4096, rope or RopeConfig(theta=500000.0)).to(DEVICE)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), ROTARY_SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_in_place_on_strided_views_matches_the_torch_rotary(heads, kv_heads, head_dim, tokens, fused_off):
    rotary = _rotary(head_dim)
    qkv, q, k, v = _qkv_views(tokens, heads, kv_heads, head_dim, torch.float32, seed=7)
    positions = _positions(tokens, 4096, seed=tokens)
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    v_before = v.clone()
    out_q, out_k = fused_kernels.apply_rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache, inplace=True)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, expected_q, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    torch.testing.assert_close(k, expected_k, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    assert torch.equal(v, v_before)


def test_rotary_out_of_place_leaves_its_inputs_alone(fused_off):
    rotary = _rotary(64, RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                    original_max_position_embeddings=1024))
    qkv, q, k, _ = _qkv_views(37, 4, 2, 64, torch.float32, seed=8)
    qkv_before = qkv.clone()
    positions = _positions(37, 4096, seed=9)
    out_q, out_k = fused_kernels.apply_rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache)
    expected_q, expected_k = rotary(positions, q, k)
    assert torch.equal(qkv, qkv_before) and out_q.is_contiguous() and out_k.is_contiguous()
    torch.testing.assert_close(out_q, expected_q, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    torch.testing.assert_close(out_k, expected_k, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)


@pytest.mark.parametrize("intermediate", [96, 1000, 1500])  # 1500: three column blocks of 512
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_matches_the_torch_activation(intermediate, tokens, fused_off):
    gate_up = _rand(tokens, 2 * intermediate, seed=10, scale=3.0)
    out = fused_kernels.silu_and_mul(gate_up)
    assert out.shape == (tokens, intermediate)
    torch.testing.assert_close(out, layers.silu_and_mul(gate_up), atol=FLOAT32_TOL, rtol=FLOAT32_TOL)


def test_empty_batches_launch_nothing():
    weight = torch.ones(96, device=DEVICE)
    assert fused_kernels.rms_norm(torch.empty(0, 96, device=DEVICE), weight, EPS).shape == (0, 96)
    out, residual = fused_kernels.fused_add_rms_norm(torch.empty(0, 96, device=DEVICE),
                                                     torch.empty(0, 96, device=DEVICE), weight, EPS)
    assert out.shape == residual.shape == (0, 96)
    assert fused_kernels.silu_and_mul(torch.empty(0, 192, device=DEVICE)).shape == (0, 96)


def _rounding_order_checks(dtype: torch.dtype, min_identical: float, kernels=fused_kernels) -> None:
    """Every kernel (or `kernels`' stand-ins) against the torch code in a 16-bit dtype: each
    intermediate the torch code stores is rounded the same way, so nearly every element is bit-identical."""
    norm = _norm_module(1000, dtype)
    x, residual = _rand(37, 1000, dtype=dtype, seed=11), _rand(37, 1000, dtype=dtype, seed=12, scale=4.0)
    out, new_residual = kernels.fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(new_residual, residual + x)
    _assert_rounding_close(out, norm(residual + x), min_identical)
    _assert_rounding_close(kernels.rms_norm(x, norm.weight, EPS), norm(x), min_identical)
    _, q, k, _ = _qkv_views(37, 32, 8, 128, dtype, seed=13)
    head_norm = _norm_module(128, dtype)
    _assert_rounding_close(kernels.rms_norm(q, head_norm.weight, EPS), head_norm(q), min_identical)
    rotary, positions = _rotary(128), _positions(37, 4096, seed=14)
    out_q, out_k = kernels.apply_rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache)
    expected_q, expected_k = rotary(positions, q, k)
    _assert_rounding_close(out_q, expected_q, min_identical)
    _assert_rounding_close(out_k, expected_k, min_identical)
    gate_up = _rand(37, 3000, dtype=dtype, seed=15, scale=3.0)
    _assert_rounding_close(kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up), min_identical)


@pytest.mark.skipif(CUDA, reason="the interpreter's float16; the gpu class checks bfloat16 natively")
def test_float16_rounds_every_intermediate_as_the_torch_code(fused_off):
    _rounding_order_checks(torch.float16, min_identical=0.999)


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x rounded to dtype and back: a rounding point of the kernels (`_rounded`, a store, or a
    16-bit mul.rn/add.rn/sub.rn of the compiled code, which rounds as the float32 op and a cast do)."""
    return x.to(dtype).float()


def _emulated_norm(x, weight, eps, dtype):
    mean_square = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    normed = _stored(x * torch.rsqrt(mean_square + eps), dtype)  # cast before the scale
    return (normed * weight.float()).to(dtype)


def _emulated_rotary(rotate_half):
    def apply_rotary(positions, q, k, cos_cache, sin_cache):
        cos = _stored(cos_cache[positions], q.dtype).unsqueeze(1)
        sin = _stored(sin_cache[positions], q.dtype).unsqueeze(1)
        return tuple(rotate_half(*x.float().chunk(2, dim=-1), cos, sin, x.dtype).to(x.dtype) for x in (q, k))

    return apply_rotary


def _emulated_silu_and_mul(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (_stored(gate / (1.0 + torch.exp(-gate)), gate_up.dtype) * up).to(gate_up.dtype)


def _fma(a, b, c, dtype):
    """a * b + c rounded once to dtype (float64 holds the product of two 16-bit floats exactly)."""
    return _stored(a.double() * b.double() + c.double(), dtype)


def _per_op_rotate(x1, x2, cos, sin, dtype):
    return torch.cat((_stored(x1 * cos, dtype) - _stored(x2 * sin, dtype),
                      _stored(x2 * cos, dtype) + _stored(x1 * sin, dtype)), dim=-1)


def _contracted_rotate(x1, x2, cos, sin, dtype):
    """As Triton 3.9 compiled the rotary for sm_90 with FP fusion on (its default then): a 16-bit
    multiply and one fma.rn per output, so x1 * cos and x1 * sin are never rounded on their own."""
    return torch.cat((_fma(x1, cos, -_stored(x2 * sin, dtype), dtype),
                      _fma(x1, sin, _stored(x2 * cos, dtype), dtype)), dim=-1)


# The kernels' arithmetic as torch ops in float32, rounded where the kernels round when compiled without
# FP fusion (as launched): each product and sum of the rotary, the new residual, the normalised value
# before the scale, the activation before the multiply, and each output.
_PER_OP_ROUNDING = SimpleNamespace(
    rms_norm=lambda x, weight, eps: _emulated_norm(x.float(), weight, eps, x.dtype),
    fused_add_rms_norm=lambda x, residual, weight, eps: (
        _emulated_norm(_stored(x.float() + residual.float(), x.dtype), weight, eps, x.dtype), residual + x),
    apply_rotary=_emulated_rotary(_per_op_rotate),
    silu_and_mul=_emulated_silu_and_mul,
)


def test_bfloat16_rounding_order_of_the_kernels_is_the_torch_codes(fused_off):
    # bit for bit on CPU (the float32 sums and rsqrt of a GPU move an element now and then)
    _rounding_order_checks(torch.bfloat16, min_identical=0.999, kernels=_PER_OP_ROUNDING)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_contracted_multiply_add_in_the_rotary_breaks_the_claim(dtype, fused_off):
    # what the native bfloat16 check measured before launches turned FP fusion off: about 81.5%
    _, q, k, _ = _qkv_views(37, 32, 8, 128, dtype, seed=13)
    rotary, positions = _rotary(128), _positions(37, 4096, seed=14)
    expected_q, expected_k = rotary(positions, q, k)
    out_q, out_k = _emulated_rotary(_contracted_rotate)(positions, q, k, rotary.cos_cache, rotary.sin_cache)
    for out, expected in ((out_q, expected_q), (out_k, expected_k)):
        assert (out == expected).float().mean().item() < 0.9


# ---- when the fused path runs -------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="checks the CPU default")
def test_cpu_tensors_take_the_torch_path_by_default(monkeypatch):
    monkeypatch.setattr(layers, "use_fused_kernels", None)
    x = torch.randn(3, 96)
    assert layers.fused_kernels_for(x) is None
    _set_fused(monkeypatch, True)
    assert layers.fused_kernels_for(x) is fused_kernels


def test_switched_off_the_fused_path_never_runs(monkeypatch):
    _set_fused(monkeypatch, False)
    assert layers.fused_kernels_for(torch.randn(3, 96, device=DEVICE)) is None


@pytest.mark.skipif(CUDA, reason="the error is for machines without CUDA")
def test_forcing_without_cuda_or_the_interpreter_says_so(monkeypatch):
    _set_fused(monkeypatch, True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA or TRITON_INTERPRET=1"):
        layers.fused_kernels_for(torch.randn(3, 96))


@pytest.mark.parametrize(("value", "setting"), [("", None), ("auto", None), ("1", True), ("on", True),
                                                ("0", False), ("OFF", False)])
def test_the_environment_variable_sets_the_mode(monkeypatch, value, setting):
    monkeypatch.setenv(layers.FUSED_KERNELS_ENV, value)
    assert layers._fused_setting_from_env() is setting


def test_an_unknown_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv(layers.FUSED_KERNELS_ENV, "sometimes")
    with pytest.raises(ValueError, match="LLMSERVE_FUSED_KERNELS must be auto, 1 or 0"):
        layers._fused_setting_from_env()


def test_the_modules_dispatch_to_the_kernels_when_forced(monkeypatch):
    norm = _norm_module(96, torch.float32)
    x, residual = _rand(5, 96, seed=16), _rand(5, 96, seed=17)
    _set_fused(monkeypatch, False)
    expected_norm, expected_residual = norm(x, residual)
    assert torch.equal(expected_residual, residual + x)
    torch.testing.assert_close(expected_norm, norm(residual + x), atol=0, rtol=0)  # the torch path: add, norm
    calls: list[str] = []

    def recording(name):
        kernel = getattr(fused_kernels, name)

        def record(*args, **kwargs):
            calls.append(name)
            return kernel(*args, **kwargs)

        return record

    for name in ("rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul"):
        monkeypatch.setattr(fused_kernels, name, recording(name))
    _set_fused(monkeypatch, True)
    got_norm, got_residual = norm(x, residual)
    assert torch.equal(got_residual, expected_residual)
    torch.testing.assert_close(got_norm, expected_norm, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    norm(x)
    _, q, k, _ = _qkv_views(5, 4, 2, 64, torch.float32, seed=18)
    _rotary(64)(_positions(5, 100, seed=19), q, k)
    layers.silu_and_mul(_rand(5, 192, seed=20))
    assert calls == ["fused_add_rms_norm", "rms_norm", "apply_rotary", "silu_and_mul"]


# ---- the tiny models, fused path on vs off ------------------------------------------------------


def _prefill_then_decode_logits(llm, monkeypatch, fused: bool) -> list[torch.Tensor]:
    """Logits of every token of a two-prompt prefill, then of one decode step of both, run on fresh
    KV caches with the fused path on or off."""
    _set_fused(monkeypatch, fused)
    runner = llm.engine.core.runner
    kv_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    first, second = [5, 17, 300, 41, 9, 77, 2], [250, 13, 600, 8, 1000, 44, 61, 19, 3, 700, 12]
    tables = [[3], [1, 0]]
    prefill = StepBatch(np.array(first + second), np.array([0, 0]), np.array([7, 11]), tables, [], [])
    decode = StepBatch(np.array([123, 456]), np.array([7, 11]), np.array([1, 1]), tables, [], [])
    logits = []
    for batch in (prefill, decode):
        input_ids, positions, meta = runner.prepare_inputs(batch)
        runner.attn_backend.prepare(meta)
        with torch.inference_mode():
            hidden = runner.model(input_ids, positions, kv_caches, runner.attn_backend, meta)
            logits.append(runner.model.compute_logits(hidden))
    return logits


def _greedy(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _engine(model_dir, monkeypatch, dtype: str, fused: bool):
    """An engine built with the fused path on or off (on CUDA its decode graphs are captured that way)."""
    from llmserve import LLM

    _set_fused(monkeypatch, fused)
    return LLM(str(model_dir), dtype=dtype, num_kv_blocks=16, max_model_len=128)


def _model_comparison(model_dir, monkeypatch, dtype: str, logits_tol: float, compare_greedy: bool) -> None:
    unfused_llm = _engine(model_dir, monkeypatch, dtype, fused=False)
    expected = _prefill_then_decode_logits(unfused_llm, monkeypatch, fused=False)
    got = _prefill_then_decode_logits(unfused_llm, monkeypatch, fused=True)
    for step_got, step_expected in zip(got, expected, strict=True):
        assert step_got.shape == step_expected.shape
        torch.testing.assert_close(step_got, step_expected, atol=logits_tol, rtol=0)
        if compare_greedy:  # float32: differences far below any top-1/top-2 margin
            assert torch.equal(step_got.argmax(-1), step_expected.argmax(-1))
    if compare_greedy:
        prompts = ["The quick brown fox", "def fibonacci(n):"]
        _set_fused(monkeypatch, False)
        expected_tokens = _greedy(unfused_llm, prompts, 6)
        fused_llm = _engine(model_dir, monkeypatch, dtype, fused=True)
        assert _greedy(fused_llm, prompts, 6) == expected_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_logits_and_greedy_tokens_match_with_the_fused_path(arch, request, monkeypatch):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    _model_comparison(model_dir, monkeypatch, "float32", logits_tol=1e-4, compare_greedy=True)


# ---- compiling for a GPU without one ------------------------------------------------------------

# Each kernel compiled for an sm_90 GPU with Triton's bundled ptxas, in a process without
# TRITON_INTERPRET (the interpreter accepts code the compiler rejects), with the options the wrappers
# launch it with. Pointers and strides carry the divisibility the JIT infers at launch. Its PTX must have
# no 16-bit multiply-add (fma.rn.bf16, fma.rn.f16x2, ...): one would skip the rounding of a product that
# the torch code stores, as the rotary kernel's did with FP fusion on.
_AOT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.model import fused_kernels as K
    from tests.model.triton_aot import assert_pdl_order

    def build(fn, dtype, consts, typed):
        for pdl in (False, True):
            compile_one(fn, dtype, {**consts, "PDL": pdl}, typed)

    def compile_one(fn, dtype, consts, typed):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            sig[name] = typed.get(name, "*" + dtype if name.endswith("_ptr") else "i32")
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=K.NO_FP_FUSION)
        opcodes = [line.split()[0] for line in compiled.asm["ptx"].splitlines() if line.strip()]
        fused = [op for op in opcodes if op.startswith("fma.") and "f16" in op]
        assert not fused, (fn.__name__, dtype, fused)
        assert_pdl_order(compiled.asm["ptx"], consts["PDL"], fn.__name__)

    for dtype in ("bf16", "fp16", "fp32"):
        for has_residual in (True, False):
            build(K.rms_norm_kernel, dtype, dict(HAS_RESIDUAL=has_residual, BLOCK=4096), {"eps": "fp32"})
        build(K.rotary_kernel, dtype, dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, Q_HEADS_PAD=32, K_HEADS_PAD=8, HALF=64,
                                           HALF_PAD=64),
              {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"})
        build(K.silu_and_mul_kernel, dtype, dict(BLOCK=K.SILU_BLOCK), {})
    print("compiled")
""")


def test_every_launch_turns_fp_fusion_off(monkeypatch):
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    for name in ("rms_norm_kernel", "rotary_kernel", "silu_and_mul_kernel"):
        monkeypatch.setattr(fused_kernels, name, Recorder(name))
    x, weight = _rand(3, 96), torch.ones(96, device=DEVICE)
    fused_kernels.rms_norm(x, weight, EPS)
    fused_kernels.fused_add_rms_norm(x, x, weight, EPS)
    _, q, k, _ = _qkv_views(3, 4, 2, 64, torch.float32, seed=28)
    fused_kernels.apply_rotary(_positions(3, 100, seed=29), q, k, *torch.ones(2, 100, 32, device=DEVICE))
    fused_kernels.silu_and_mul(_rand(3, 192))
    assert [name for name, _ in launches] == ["rms_norm_kernel", "rms_norm_kernel", "rotary_kernel",
                                              "silu_and_mul_kernel"]
    assert all(kwargs.items() >= fused_kernels.NO_FP_FUSION.items() for _, kwargs in launches)
    assert fused_kernels.NO_FP_FUSION == {"enable_fp_fusion": False}


def test_kernels_compile_for_a_cuda_gpu():
    assert_compiles_for_sm90(_AOT)


# ---- natively on a GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
class TestNativeBfloat16:
    def test_kernels_round_every_intermediate_as_the_torch_code(self, fused_off):
        _rounding_order_checks(torch.bfloat16, min_identical=0.99)

    def test_kernels_replay_in_a_cuda_graph(self, fused_off):
        norm, rotary = _norm_module(4096, torch.bfloat16), _rotary(128)
        x, residual = _rand(8, 4096, dtype=torch.bfloat16, seed=21), _rand(8, 4096, dtype=torch.bfloat16, seed=22)
        _, q, k, _ = _qkv_views(8, 32, 8, 128, torch.bfloat16, seed=23)
        gate_up, positions = _rand(8, 2 * 14336, dtype=torch.bfloat16, seed=24), _positions(8, 4096, seed=25)

        def step():
            normed, new_residual = fused_kernels.fused_add_rms_norm(x, residual, norm.weight, EPS)
            out_q, out_k = fused_kernels.apply_rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache)
            return normed, new_residual, out_q, out_k, fused_kernels.silu_and_mul(gate_up)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        for seed in (26, 27):  # new inputs in the same buffers
            x.copy_(_rand(8, 4096, dtype=torch.bfloat16, seed=seed))
            positions.copy_(_positions(8, 4096, seed=seed))
            graph.replay()
            for got, expected in zip(outputs, step(), strict=True):
                assert torch.equal(got, expected)

    @pytest.mark.parametrize("arch", ["llama", "qwen3"])
    def test_tiny_model_matches_in_bfloat16(self, arch, request, monkeypatch):
        model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
        _model_comparison(model_dir, monkeypatch, "bfloat16", logits_tol=0.5, compare_greedy=False)

    @pytest.mark.parametrize("arch", ["llama", "qwen3"])
    def test_tiny_model_matches_in_float32(self, arch, request, monkeypatch):
        model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
        _model_comparison(model_dir, monkeypatch, "float32", logits_tol=1e-4, compare_greedy=True)
