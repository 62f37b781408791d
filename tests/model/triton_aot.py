"""Compiling Triton kernels for an sm_90 GPU on a machine without one: the script runs in a subprocess
without TRITON_INTERPRET (which the kernel tests set before importing Triton) and prints "compiled"."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


def assert_compiles_for_sm90(script: str) -> None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's warning; launches set it themselves
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def assert_pdl_order(ptx: str, pdl: bool, kernel: str) -> None:
    """Compiled for programmatic dependent launch (`llmserve.pdl`), a kernel touches global memory only
    after its wait and lets the next kernel launch; compiled without, it does neither. Called by the
    compile scripts."""
    wait = ptx.find("griddepcontrol.wait")
    assert (wait >= 0) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl, (kernel, pdl)
    if pdl:
        before = ptx[:wait]
        touched = [op for op in ("ld.global", "st.global", "atom.", "red.", "cp.async") if op in before]
        assert not touched, (kernel, touched)
