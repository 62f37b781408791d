"""Quantized linear layers (int8, fp8) against dequantize-then-matmul; checkpoints already quantized
(compressed-tensors int8 / pack-quantized / fp8, fp8 per-tensor and block layouts) against quantizing
at load; unsupported quantization configs and flags; the engine serving with int8 weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.cli import build_parser
from llmserve.config import QUANTIZATION_CHOICES, EngineConfig, engine_config_kwargs
from llmserve.errors import ModelLoadError
from llmserve.model.config import ModelConfig
from llmserve.model.layers import Linear
from llmserve.model.quantization import QUANTIZATION_METHODS
from llmserve.model.quantization.checkpoint import unpack_int8
from llmserve.model.quantization.fp8 import FP8_DTYPE, Fp8LinearMethod, quantize_fp8, scaled_mm_supported
from llmserve.model.quantization.int8 import Int8LinearMethod, quantize_int8
from llmserve.model.runner import ModelRunner, StepBatch

# (out, in): the medium model's projections, and odd sizes (an input size off the CPU int8 kernel's 16)
SHAPES = [(2048, 1024), (1024, 2816), (255, 96), (130, 200), (7, 33)]
ROWS = [1, 3, 17, 64]
METHODS = {"int8": (Int8LinearMethod, quantize_int8), "fp8": (Fp8LinearMethod, quantize_fp8)}
# Relative to the reference's largest magnitude: bf16 output rounding (2^-8) and accumulation order.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _quantized_linear(method_name: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    method_cls, quantize = METHODS[method_name]
    layer = Linear(weight.shape[1], weight.shape[0], bias is not None, dtype)
    q, scale = quantize(weight)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    if bias is not None:
        layer.bias.data.copy_(bias)
    method = method_cls()
    method.process_weights(layer, dtype)
    layer.quant_method = method
    return layer


def _dequantized(layer: Linear) -> torch.Tensor:
    return layer.weight.double() * layer.weight_scale.double()[:, None]


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_dequantize_then_matmul(method, out_features, in_features, dtype):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen).to(dtype) if out_features % 2 else None
    layer = _quantized_linear(method, weight, bias, dtype)
    if method == "int8" and in_features % 16 == 0:
        assert layer.use_int8_kernel  # the product's CPU kernel, not the generic path
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        expected = x.double() @ _dequantized(layer).T + (0 if bias is None else bias.double())
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, out_features)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=TOLERANCE[dtype] * expected.abs().max().item())


def test_int8_quantizer_rounds_to_nearest_within_half_a_step():
    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]
    weight[5] = 0.0
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scale[5] == 1.0
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), 127, dtype=torch.int8))
    error = (q.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 1e-6)).all())


def test_fp8_quantizer_uses_the_full_e4m3_range():
    weight = torch.randn(32, 64)
    q, scale = quantize_fp8(weight)
    assert q.dtype == FP8_DTYPE
    torch.testing.assert_close(q.float().abs().amax(dim=1), torch.full((32,), 448.0))
    relative = (q.float() * scale[:, None] - weight).abs() / weight.abs().clamp(min=scale[:, None] * 2**-6)
    assert float(relative.max()) <= 2**-4  # e4m3: 3 mantissa bits, round to nearest


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and scaled_mm_supported(torch.device("cuda"))),
                    reason="needs a CUDA GPU with fp8 matmul (compute capability 8.9+)")
@pytest.mark.parametrize("rows", ROWS)
def test_fp8_scaled_mm_matches_dequantize_then_matmul(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2048, 1024, generator=gen) * 0.05).cuda()
    layer = _quantized_linear("fp8", weight, None, torch.bfloat16).cuda()
    layer.quant_method.process_weights(layer, torch.bfloat16)
    assert layer.use_scaled_mm
    x = torch.randn(rows, 1024, generator=gen).cuda().bfloat16()
    expected = x.double() @ _dequantized(layer).T
    # activations are quantized to e4m3 per token too: 2^-4 relative error per element, averaging out
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=0.05 * expected.abs().max().item())


# ---- checkpoints --------------------------------------------------------------------------------

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3, 64, 128, 255, 511]


def _write_checkpoint(src: Path, dst: Path, quantization_config: dict, convert) -> Path:
    """A copy of `src` whose linear weights `convert(name, tensor)` rewrites (a dict of tensors each)."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = {}
        for name, tensor in load_file(file).items():
            tensors.update(convert(name, tensor) if name.endswith(LINEAR_SUFFIXES) else {name: tensor})
        save_file(tensors, file)
    config = json.loads((dst / "config.json").read_text())
    if quantization_config:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _compressed_tensors_config(kind: str, fmt: str, strategy: str = "channel", **weights) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False,
                        **weights},
            "input_activations": None,
        }},
    }


def _runner(model_dir: Path, **kwargs) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=4, block_size=16, **kwargs)
    return ModelRunner(config, ModelConfig.from_pretrained(model_dir), model_dir, max_model_len=64)


@torch.inference_mode()
def _prompt_hidden(runner: ModelRunner) -> torch.Tensor:
    """The final hidden states at every position of PROMPT, prefilled in one step into the runner's own cache."""
    batch = StepBatch(
        input_ids=np.array(PROMPT, dtype=np.int64), num_computed=np.array([0]), num_new=np.array([len(PROMPT)]),
        block_tables=[[0]], logits_rows=[], sampling_rows=[],
    )
    input_ids, positions, meta = runner.prepare_inputs(batch)
    runner.attn_backend.prepare(meta)
    return runner.model(input_ids, positions, runner.kv_caches, runner.attn_backend, meta)


@torch.inference_mode()
def _prompt_logits(runner: ModelRunner) -> torch.Tensor:
    return runner.model.compute_logits(_prompt_hidden(runner))


def _pack_int8(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' 8-bit packing: four values (+128) per int32, value i in byte i; rows padded."""
    rows, cols = q.shape
    padded = torch.zeros(rows, -(-cols // 4) * 4, dtype=torch.uint8)
    padded[:, :cols] = (q.to(torch.int16) + 128).to(torch.uint8)
    words = padded.view(rows, -1, 4).to(torch.int64)
    packed = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24
    return packed.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else packed.to(torch.int32)


def test_pack_int8_round_trips_through_the_loader():
    q = torch.randint(-127, 128, (5, 13), dtype=torch.int8)
    assert torch.equal(unpack_int8(_pack_int8(q), torch.tensor([5, 13])), q)


def _int8_tensors(name, tensor):
    q, scale = quantize_int8(tensor)
    module = name.removesuffix(".weight")
    return {name: q, f"{module}.weight_scale": scale[:, None]}


def _int8_packed_tensors(name, tensor):
    q, scale = quantize_int8(tensor)
    module = name.removesuffix(".weight")
    return {f"{module}.weight_packed": _pack_int8(q), f"{module}.weight_shape": torch.tensor(q.shape),
            f"{module}.weight_scale": scale[:, None]}


def _fp8_channel_tensors(name, tensor):
    q, scale = quantize_fp8(tensor)
    module = name.removesuffix(".weight")
    tensors = {name: q, f"{module}.weight_scale": scale[:, None], f"{module}.input_scale": torch.ones(1)}
    if module.endswith("k_proj"):  # a KV-cache scale beside the layer's projections (not used)
        tensors[module.replace("k_proj", "k_scale")] = torch.ones(())
    return tensors


@pytest.mark.parametrize(("method", "quantization_config", "convert"), [
    ("int8", _compressed_tensors_config("int", "int-quantized"), _int8_tensors),
    ("int8", _compressed_tensors_config("int", "pack-quantized"), _int8_packed_tensors),
    ("fp8", _compressed_tensors_config("float", "float-quantized"), _fp8_channel_tensors),
])
def test_prequantized_checkpoint_gives_the_logits_of_quantizing_at_load(
    tiny_llama_dir, tmp_path, method, quantization_config, convert
):
    quantized_dir = _write_checkpoint(tiny_llama_dir, tmp_path / "quantized", quantization_config, convert)
    from_checkpoint = _runner(quantized_dir)
    at_load = _runner(tiny_llama_dir, quantization=method)
    assert from_checkpoint.model.layers[0].mlp.down_proj.weight.dtype == at_load.model.layers[0].mlp.down_proj.weight.dtype
    torch.testing.assert_close(_prompt_logits(from_checkpoint), _prompt_logits(at_load), rtol=0, atol=0)


def _dequantized_checkpoint(src: Path, dst: Path, convert) -> Path:
    """The float32 checkpoint holding exactly what `convert`'s quantized tensors stand for."""
    def dequantize(name, tensor):
        quantized = convert(name, tensor)
        scale = quantized.get(name.replace(".weight", ".weight_scale"))
        if scale is None:
            return {name: _undo_blocks(quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")])}
        return {name: quantized[name].float() * scale.float()}
    return _write_checkpoint(src, dst, {}, dequantize)


def _fp8_tensor_tensors(name, tensor):
    scale = tensor.abs().max().reshape(1) / 448.0  # AutoFP8: one scale per tensor, static input scale
    module = name.removesuffix(".weight")
    return {name: (tensor / scale).to(FP8_DTYPE), f"{module}.weight_scale": scale, f"{module}.input_scale": scale.clone()}


BLOCK = (32, 16)


def _fp8_block_tensors(name, tensor):
    rows, cols = tensor.shape
    blocks = tensor.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(FP8_DTYPE)
    return {name: q, name.replace(".weight", ".weight_scale_inv"): scale}


def _undo_blocks(q, scale):
    return q.float() * scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)


def test_fp8_per_tensor_checkpoint_matches_its_dequantized_weights(tiny_llama_dir, tmp_path):
    """Per-tensor scales (AutoFP8, static input scales read past) become per-channel by repetition: the
    model computes with exactly the checkpoint's weights, up to float32 rounding."""
    config = {"quant_method": "fp8", "activation_scheme": "static"}
    quantized_dir = _write_checkpoint(tiny_llama_dir, tmp_path / "fp8", config, _fp8_tensor_tensors)
    reference_dir = _dequantized_checkpoint(tiny_llama_dir, tmp_path / "dequantized", _fp8_tensor_tensors)
    # On CPU: a GPU with fp8 tensor cores runs a prompt's linears W8A8, its activations quantized too.
    logits = _prompt_logits(_runner(quantized_dir, device="cpu"))
    expected = _prompt_logits(_runner(reference_dir, device="cpu"))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4 * expected.abs().max().item())


def test_fp8_block_checkpoint_is_requantized_per_channel(tiny_llama_dir, tmp_path):
    """Block scales (weight_scale_inv) are folded in and each output channel requantized: the logits of
    quantizing the checkpoint's dequantized weights to fp8 at load, exactly."""
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    quantized_dir = _write_checkpoint(tiny_llama_dir, tmp_path / "fp8", config, _fp8_block_tensors)
    reference_dir = _dequantized_checkpoint(tiny_llama_dir, tmp_path / "dequantized", _fp8_block_tensors)
    logits = _prompt_logits(_runner(quantized_dir))
    torch.testing.assert_close(logits, _prompt_logits(_runner(reference_dir, quantization="fp8")), rtol=0, atol=0)


@pytest.mark.parametrize(("quantization_config", "named"), [
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    (_compressed_tensors_config("int", "pack-quantized", num_bits=4), "4-bit"),
    (_compressed_tensors_config("int", "int-quantized", symmetric=False), "asymmetric"),
    (_compressed_tensors_config("int", "int-quantized", strategy="group", group_size=128), "'group'"),
])
def test_unsupported_quantization_config_names_what_is_supported(tiny_llama_dir, tmp_path, quantization_config, named):
    model_dir = _write_checkpoint(tiny_llama_dir, tmp_path / "model", quantization_config, lambda n, t: {n: t})
    with pytest.raises(ModelLoadError) as error:
        LLM(str(model_dir), dtype="float32", num_kv_blocks=8, max_model_len=64)
    assert named in str(error.value)
    assert "Supported: compressed-tensors" in str(error.value) or "supported: compressed-tensors" in str(error.value)


def test_quantization_flag_must_match_a_quantized_checkpoint(tiny_llama_dir, tmp_path):
    model_dir = _write_checkpoint(tiny_llama_dir, tmp_path / "int8", _compressed_tensors_config("int", "int-quantized"),
                                  _int8_tensors)
    with pytest.raises(ModelLoadError, match="already quantized to int8"):
        _runner(model_dir, quantization="fp8")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantize_lm_head_gives_the_logits_of_its_quantized_weights(tiny_qwen3_dir, method):
    """With --quantize-lm-head the head is quantized like the other layers (from the checkpoint's tensor, at
    load) and the logits are the final hidden states times its dequantized weights; without it the head
    keeps the checkpoint's weights and the rest of the model is the same."""
    head = load_file(tiny_qwen3_dir / "model.safetensors")["lm_head.weight"]
    # on the CPU, where fp8 is weight-only at every size (a GPU quantizes a prompt's activations too)
    quantized_head = _runner(tiny_qwen3_dir, quantization=method, quantize_lm_head=True, device="cpu")
    full_head = _runner(tiny_qwen3_dir, quantization=method, device="cpu")
    q, scale = METHODS[method][1](head.float())
    assert torch.equal(quantized_head.model.lm_head.weight.view(torch.int8), q.view(torch.int8))
    assert full_head.model.lm_head.weight.dtype == torch.float32
    hidden = _prompt_hidden(quantized_head)
    torch.testing.assert_close(hidden, _prompt_hidden(full_head), rtol=0, atol=0)
    expected = hidden.double() @ (q.double() * scale.double()[:, None]).T
    logits = _prompt_logits(quantized_head)
    torch.testing.assert_close(logits.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert not torch.equal(logits, _prompt_logits(full_head))


def test_quantize_lm_head_refuses_what_it_cannot_do(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="lm_head is its input embedding table"):
        _runner(tiny_llama_dir, quantization="int8", quantize_lm_head=True)  # tied embeddings
    with pytest.raises(ValueError, match="--quantize-lm-head needs --quantization"):
        _runner(tiny_qwen3_dir, quantize_lm_head=True)
    quantized_dir = _write_checkpoint(tiny_qwen3_dir, tmp_path / "int8", _compressed_tensors_config("int", "int-quantized"),
                                      _int8_tensors)
    with pytest.raises(ModelLoadError, match="already quantized, and its quantization_config decides"):
        _runner(quantized_dir, quantize_lm_head=True)


def test_quantization_flag_values():
    assert QUANTIZATION_CHOICES == QUANTIZATION_METHODS  # the torch-free flag's copy
    parser = build_parser()
    args = parser.parse_args(["serve", "--quantization", "int8", "--kv-cache-dtype", "fp8"])
    kwargs = engine_config_kwargs(args)
    assert (kwargs["quantization"], kwargs["kv_cache_dtype"], kwargs["quantize_lm_head"]) == ("int8", "fp8", False)
    assert engine_config_kwargs(parser.parse_args(["serve", "--quantization", "fp8", "--quantize-lm-head"]))["quantize_lm_head"]
    assert engine_config_kwargs(parser.parse_args(["serve"]))["quantization"] is None
    assert engine_config_kwargs(parser.parse_args(["serve", "--kv-cache-dtype", "int8"]))["kv_cache_dtype"] == "int8"
    for bad in (["--quantization", "int4"], ["--kv-cache-dtype", "int4"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["serve", *bad])
        assert exit_info.value.code == 2
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8"):
        EngineConfig(model="m", quantization="awq").validate()


def test_engine_serves_int8_weights_without_leaking_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization="int8", num_kv_blocks=32, max_model_len=256,
              max_num_batched_tokens=32)
    runner = llm.engine.core.runner
    assert runner.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.int8
    assert runner.model.embed_tokens.weight.dtype == torch.float32  # embeddings (and the tied head) stay unquantized
    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12, 12]
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids  # deterministic
    blocks = llm.engine.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_fp8_kv_cache_on_the_torch_backend_says_why_not(tiny_llama_dir):
    with pytest.raises(ValueError, match="cannot keep the KV cache in torch.float8_e4m3fn.*needs the 'triton' backend"):
        LLM(str(tiny_llama_dir), attention_backend="torch", kv_cache_dtype="fp8", num_kv_blocks=8, max_model_len=64)
