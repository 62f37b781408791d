"""The programmatic-dependent-launch switch (`llmserve.pdl`): where it applies and how it is set. The kernels'
PTX with it on is checked by each kernel file's sm_90 compile test; its outputs on a GPU by
test_gpu_runner's `test_programmatic_dependent_launch_changes_no_token`."""

from __future__ import annotations

import pytest
import torch

from llmserve import pdl


def test_cpu_tensors_never_launch_with_it(monkeypatch):
    assert pdl.launch_options(torch.empty(1)) == {"PDL": False}
    monkeypatch.setattr(pdl, "enabled", True)
    assert pdl.launch_options(torch.empty(1)) == {"PDL": False}


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("", True), ("0", False), ("off", False),
                                                 ("1", True), ("sometimes", None)])
def test_the_environment_variable_turns_it_off(monkeypatch, value, expected):
    """What the module reads once, at import, into `pdl.enabled`."""
    if value is None:
        monkeypatch.delenv(pdl.ENV, raising=False)
    else:
        monkeypatch.setenv(pdl.ENV, value)
    if expected is None:
        with pytest.raises(ValueError, match="LLMSERVE_PDL must be 1 or 0 \\(got 'sometimes'\\)"):
            pdl._setting_from_env()
    else:
        assert pdl._setting_from_env() is expected
