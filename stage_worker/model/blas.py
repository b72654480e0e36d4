"""Which BLAS a stage's MLX uses on Linux, and how the launcher swaps in a fast one.

MLX's Linux CPU wheel links the reference (netlib) BLAS, on which batching gains nothing. Preloading an
optimized BLAS that exports the standard CBLAS symbols replaces it for the whole process (docs/performance.md,
"Linux CPU", has the gain). ``find_optimized_blas`` picks one, best first: Debian's OpenBLAS
(``libopenblas0-pthread``), then Intel MKL's ``libmkl_rt`` from the PyPI ``mkl`` wheel; ``STAGEMESH_BLAS``
overrides (``none`` keeps the reference BLAS, a path preloads that library). ``reexec_with_optimized_blas``
re-executes the stage entry point once with ``LD_PRELOAD`` set (it only takes effect when a process starts);
``loaded_blas`` says which one a process uses. macOS uses Accelerate and Metal; nothing is done there.
``AdaptiveBlasThreads`` sizes the BLAS's thread pool to the pipeline's load (``threads_for_load``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Mapping

from stagemesh_core import settings
from stagemesh_core.errors import UserError

_REEXEC_MARK = "STAGEMESH_BLAS_REEXEC"

_DEBIAN_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


def find_optimized_blas(env: Mapping[str, str] = os.environ) -> str | None:
    """Path of the BLAS to preload, or None (reference BLAS, or not Linux)."""
    choice = settings.read("BLAS", env)
    if not sys.platform.startswith("linux") or choice == "none":
        return None
    if choice != "auto":
        if not os.path.exists(choice):
            raise UserError(f"{settings.env_name('BLAS')}={choice!r} does not exist; give a BLAS library path, "
                            f"auto or none")
        return choice
    for path in _DEBIAN_OPENBLAS:
        if os.path.exists(path):
            return path
    mkl = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
    return mkl[0] if mkl else None


# OpenBLAS worker threads spin (sched_yield) for 2**28 cycles after each call before they
# sleep; on a host shared with other stages that spinning takes the cores the stage that
# computes next needs, so there they are told to sleep after 2**4.
_IDLE_SPIN_ENV = "OPENBLAS_THREAD_TIMEOUT"
_SHORT_IDLE_SPIN = "4"


def blas_environment(env: Mapping[str, str], library: str | None, threads: int | None,
                     shared_host: bool = False) -> dict[str, str]:
    """``env`` with ``library`` preloaded, its thread count set and, on a host whose cores
    other stages need, its idle threads told to sleep at once (pure)."""
    out = dict(env)
    if library is None:
        return out
    preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p]
    if library not in preload:
        out["LD_PRELOAD"] = ":".join([library, *preload])
    if threads:
        for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            out.setdefault(name, str(threads))
    if shared_host:
        out.setdefault(_IDLE_SPIN_ENV, _SHORT_IDLE_SPIN)
    return out


def reexec_with_optimized_blas(argv: list[str], threads: int | None, shared_host: bool = False) -> None:
    """Replace this process with one that has the optimized BLAS preloaded (same pid); no-op if
    there is none, it is loaded already, or we re-executed once already."""
    library = find_optimized_blas()
    if library is None or os.environ.get(_REEXEC_MARK) == "1":
        return
    if library in os.environ.get("LD_PRELOAD", "").split(":"):
        return
    env = blas_environment(os.environ, library, threads, shared_host)
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


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. after pinning), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_for_load(in_flight: int, cores: int, stages_on_host: int) -> int:
    """BLAS threads for a batch computed while ``in_flight`` batches are in the pipeline (pure).

    One batch in flight: the other stages wait, so all ``cores`` are this stage's. Several: up to
    ``min(in_flight, stages_on_host)`` stages of this host compute at once and split the cores between
    them instead of fighting over them. ``in_flight`` 0 means unknown: assume the host is fully busy.
    """
    busy_here = stages_on_host if in_flight <= 0 else min(in_flight, stages_on_host)
    return max(1, cores // max(1, busy_here))


class AdaptiveBlasThreads:
    """Resizes the loaded BLAS's thread pool with the pipeline's load (see ``threads_for_load``).

    A fixed ``STAGEMESH_BLAS_THREADS`` turns adaptation off; so does a BLAS without a runtime
    setter (the reference BLAS is single-threaded anyway).
    """

    def __init__(self, cores: int, stages_on_host: int, fixed: int | None = None) -> None:
        self.cores, self.stages_on_host, self.fixed = cores, max(1, stages_on_host), fixed
        self._setter = None if fixed else _thread_setter()
        self.current: int | None = None

    @property
    def adaptive(self) -> bool:
        return self._setter is not None

    def for_load(self, in_flight: int) -> int:
        """Set the pool for a batch computed with ``in_flight`` batches in the pipeline; returns threads."""
        if self._setter is None:
            return self.fixed or self.current or 0
        threads = threads_for_load(in_flight, self.cores, self.stages_on_host)
        if threads != self.current:
            self._setter(threads)
            self.current = threads
        return threads


def _thread_setter():
    """The loaded BLAS's runtime thread-count setter (OpenBLAS or MKL), or None."""
    try:
        process = ctypes.CDLL(None)
    except OSError:
        return None
    for name in ("openblas_set_num_threads", "MKL_Set_Num_Threads"):
        function = getattr(process, name, None)
        if function is not None:
            function.argtypes, function.restype = [ctypes.c_int], None
            return function
    return None
