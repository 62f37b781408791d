"""A test plugin (`LLMSERVE_PLUGINS=tests.faulty_model`): `FaultyLlamaForCausalLM` is the Llama model,
except that a forward pass over the token `FAULT_TOKEN` raises, so a test can make an engine step
fail on demand, in whichever process the engine core runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.registry import register_model

ARCHITECTURE = "FaultyLlamaForCausalLM"
FAULT_TOKEN = 1013


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if bool((input_ids == FAULT_TOKEN).any()):
            raise RuntimeError("injected fault: the step saw the fault token")
        return super().forward(input_ids, *args, **kwargs)


register_model(ARCHITECTURE, FaultyLlamaForCausalLM)


def faulty_copy(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` (a Llama checkpoint) served by the faulty model."""
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config_path.write_text(json.dumps(config))
    return out_dir
