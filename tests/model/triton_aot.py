"""Compiling Triton kernels for an sm_90 GPU on a machine without one: the script runs in a subprocess
without TRITON_INTERPRET (which the kernel tests set before importing Triton) and prints "compiled".

Each kernel test module keeps its script in `_AOT` and checks it in one of `COMPILE_TESTS`. A cold compile of them
all takes over a minute of one core, so once the session has collected its tests (`start_ahead`, from
conftest.py) the selected ones are compiled one after another on a thread, at the lowest CPU priority: the suite
leaves about half of two cores idle, and the tests only wait for their results."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterable

import pytest

COMPILE_TESTS = ("test_kernels_compile_for_a_cuda_gpu", "test_kernel_compiles_for_a_cuda_gpu")

_ahead: dict[str, tuple[threading.Event, list[subprocess.CompletedProcess]]] = {}  # script -> (done, its result)


def _has_nvidia_backend() -> bool:
    return importlib.util.find_spec("triton.backends.nvidia") is not None


def _compile(script: str, niceness: int = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's warning; launches set it themselves
    nice = ["nice", "-n", str(niceness)] if niceness else []
    return subprocess.run([*nice, sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


def start_ahead(items: Iterable[pytest.Item]) -> None:
    """Compile the scripts of the selected compile tests on a background thread, one after another."""
    scripts = [item.module._AOT for item in items if getattr(item, "originalname", None) in COMPILE_TESTS]
    if not scripts or not _has_nvidia_backend():
        return
    for script in scripts:
        _ahead[script] = (threading.Event(), [])

    def run() -> None:
        for script in scripts:
            done, result = _ahead[script]
            try:
                result.append(_compile(script, niceness=19))
            finally:
                done.set()

    threading.Thread(target=run, name="sm90-compiles", daemon=True).start()


def assert_compiles_for_sm90(script: str) -> None:
    if not _has_nvidia_backend():
        pytest.skip("this triton has no NVIDIA backend")
    if script in _ahead:
        done, result = _ahead[script]
        done.wait()
        assert result, "its compile on the background thread failed to run"
        finished = result[0]
    else:  # not collected with the session (a module's own run from another entry point)
        finished = _compile(script)
    assert finished.returncode == 0 and "compiled" in finished.stdout, finished.stderr[-3000:]


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
