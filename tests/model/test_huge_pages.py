"""A CPU model's weights moved onto a mapping advised for transparent huge pages: the same values, the engine
serving from them, and the mapping advised as the kernel reports it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model import huge_pages
from llmserve.model.builtin import ensure_default_model
from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM

needs_madvise = pytest.mark.skipif(not huge_pages.applies(), reason="transparent huge pages are not in madvise mode here")


def _model() -> LlamaForCausalLM:
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })
    model = LlamaForCausalLM(cfg)
    model.init_dummy_weights(seed=3)
    return model.eval()


def _arena_range(arena) -> tuple[int, int]:
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    return start, start + len(arena)


def _vm_flags(start: int) -> list[str]:
    """The VmFlags of the mapping that starts at `start`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if match and int(match.group(1), 16) <= start < int(match.group(2), 16):
            flags = next(entry for entry in lines[i + 1 :] if entry.startswith("VmFlags:"))
            return flags.split()[1:]
    raise AssertionError("mapping not found")


@needs_madvise
def test_parameters_move_into_an_advised_mapping_unchanged():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    arena = huge_pages.move_parameters(model)
    assert arena is not None
    start, end = _arena_range(arena)
    for name, param in model.named_parameters():
        assert start <= param.data_ptr() < end and param.data_ptr() % huge_pages.ALIGN == 0, name
        assert param.dtype == before[name].dtype and torch.equal(param, before[name]), name
    assert "hg" in _vm_flags(start)  # MADV_HUGEPAGE, as the kernel records it


@needs_madvise
def test_the_engine_serves_from_the_advised_mapping():
    # the values are the same bits (above), so the tokens are too: this checks that the runner moves them
    llm = LLM(ensure_default_model("llama", "tiny"), dtype="bfloat16")
    runner = llm.engine.core.runner
    start, end = _arena_range(runner.weight_arena)
    assert all(start <= p.data_ptr() < end for p in runner.model.parameters())
    out = llm.generate({"prompt_token_ids": [11, 42, 7]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_switch_and_other_modes_leave_parameters_where_they_are(monkeypatch):
    model = _model()
    pointers = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.move_parameters(model) is None
    monkeypatch.delenv(huge_pages.ENV)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "always")
    assert huge_pages.move_parameters(model) is None
    assert [p.data_ptr() for p in model.parameters()] == pointers
