"""Which BLAS a stage's MLX uses on Linux, and how the launcher swaps in a fast one.

MLX's Linux CPU wheel links the reference (netlib) BLAS: every float GEMM runs
at a few GFLOP/s and batching gains nothing. Preloading an optimized BLAS that
exports the standard CBLAS symbols replaces it for the whole process (measured
here: a 576x1536 float32 GEMV 4.7x faster; float32 decode at batch 16 ~10x).
Candidates, best first: Debian's OpenBLAS (``libopenblas0-pthread``), then
Intel MKL's ``libmkl_rt`` from the PyPI ``mkl`` wheel. ``STAGEMESH_BLAS``
overrides: ``none`` keeps the reference BLAS, a path preloads that library.

``LD_PRELOAD`` only takes effect when a process starts, so the stage entry
point (``python -m stage_worker``) re-executes itself once with it set. macOS
uses Accelerate and Metal; nothing is done there.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping

BLAS_ENV = "STAGEMESH_BLAS"
THREADS_ENV = "STAGEMESH_BLAS_THREADS"
_REEXEC_MARK = "STAGEMESH_BLAS_REEXEC"

_DEBIAN_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


def find_optimized_blas(env: Mapping[str, str] = os.environ) -> str | None:
    """Path of the BLAS to preload, or None (reference BLAS, or not Linux)."""
    choice = env.get(BLAS_ENV, "auto")
    if not sys.platform.startswith("linux") or choice == "none":
        return None
    if choice != "auto":
        if not os.path.exists(choice):
            raise ValueError(f"{BLAS_ENV}={choice!r} does not exist; give a BLAS library path, auto or none")
        return choice
    for path in _DEBIAN_OPENBLAS:
        if os.path.exists(path):
            return path
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return mkl[0] if mkl else None


def blas_environment(env: Mapping[str, str], library: str | None, threads: int | None) -> dict[str, str]:
    """``env`` with ``library`` preloaded and its thread count set (pure)."""
    out = dict(env)
    if library is None:
        return out
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
    if library not in preload:
        out["LD_PRELOAD"] = ":".join([library, *preload])
    if threads:
        for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            out.setdefault(name, str(threads))
    return out


def reexec_with_optimized_blas(argv: list[str], threads: int | None) -> None:
    """Replace this process with one that has the optimized BLAS preloaded (same pid); no-op if
    there is none, it is loaded already, or we re-executed once already."""
    library = find_optimized_blas()
    if library is None or os.environ.get(_REEXEC_MARK) == "1":
        return
    if library in os.environ.get("LD_PRELOAD", "").split(":"):
        return
    env = blas_environment(os.environ, library, threads)
    env[_REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, *argv], env)


def loaded_blas() -> str:
    """What this process actually uses: 'openblas', 'mkl', 'reference' or 'accelerate' (macOS)."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    if "libopenblas" in text:
        return "openblas"
    if "libmkl_rt" in text:
        return "mkl"
    return "reference"
