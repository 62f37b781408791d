"""Building and loading the C kernels for CPUs (`csrc/` beside the modules that use them).

Each kernel is one C file compiled on first use with the system C compiler and OpenMP (gcc or clang,
`-march=native`, so the AVX-512 paths are compiled where the machine has them), cached as a shared object
under the llmserve cache directory keyed by the source, the flags and the machine, and called through
ctypes with raw pointers, so no PyTorch headers are needed. Without a compiler, or when the build fails,
`load_library` returns None and callers keep their PyTorch path.

LLMSERVE_CPU_KERNELS: 1 (default) uses every kernel on its best path, 0 turns them all off, `portable`
keeps them on their plain-C implementation (for comparisons and for testing machines without AVX-512).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_KERNELS"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
INCLUDE_DIR = Path(__file__).parent / "csrc"  # headers every kernel may include (bf16.h)


def kernels_enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def portable_from_env() -> bool:
    return os.environ.get(ENV) == "portable"


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo, or "" where it does not say (read once per name)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...), or "" where /proc/cpuinfo does not say."""
    return _cpuinfo_field("vendor_id")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("avx512_bf16", "amx_bf16", ...); empty where /proc/cpuinfo does not say."""
    return frozenset(_cpuinfo_field("flags").split())


def _cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmserve"
    )
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def load_library(source: Path, included: Sequence[Path] = (), defines: Sequence[str] = ()) -> ctypes.CDLL | None:
    """`source` built (or found in the cache) and loaded; None when kernels are off or it cannot be built.
    `included`: the other C files that `source` #includes, so that editing them rebuilds it; `defines`:
    NAME=VALUE macros for the build (benchmarks build variants of a tuning constant side by side)."""
    if not kernels_enabled():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found: %s is not used, the PyTorch path runs instead", source.name)
        return None
    headers = b"".join(path.read_bytes() for path in [*sorted(INCLUDE_DIR.glob("*.h")), *included])
    flags = [*FLAGS, *(f"-D{define}" for define in defines)]
    key = hashlib.sha256(
        source.read_bytes() + headers + " ".join([compiler, *flags, platform.node(), platform.machine()]).encode()
    )
    target = _cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("building %s failed (%s); the PyTorch path runs instead", source.name, exc)
        return None


def _build(compiler: str, flags: Sequence[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, f"-I{INCLUDE_DIR}", str(source), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
