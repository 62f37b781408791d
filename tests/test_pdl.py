"""The programmatic-dependent-launch switch (`llmserve.pdl`): where it applies and how it is set. The kernels'
PTX with it on is checked by each kernel file's sm_90 compile test; its outputs on a GPU by
test_gpu_runner's `test_programmatic_dependent_launch_changes_no_token`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmserve import pdl


def test_cpu_tensors_never_launch_with_it(monkeypatch):
    assert pdl.launch_options(torch.empty(1)) == {"PDL": False}
    monkeypatch.setattr(pdl, "enabled", True)
    assert pdl.launch_options(torch.empty(1)) == {"PDL": False}


@pytest.mark.parametrize(("value", "expected"), [(None, "True"), ("", "True"), ("0", "False"), ("off", "False"),
                                                 ("1", "True"), ("sometimes", None)])
def test_the_environment_variable_turns_it_off(value, expected):
    env = {name: v for name, v in os.environ.items() if name != pdl.ENV} | ({} if value is None else {pdl.ENV: value})
    done = subprocess.run([sys.executable, "-c", "from llmserve import pdl; print(pdl.enabled)"], env=env,
                          capture_output=True, text=True, timeout=120)
    if expected is None:
        assert done.returncode != 0 and "LLMSERVE_PDL must be 1 or 0 (got 'sometimes')" in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.split() == [expected], done.stderr[-2000:]
