"""Shared test helpers: free port ranges on loopback, the default model's path, a tiny config-only model.

Two tiers: ``python -m pytest -m "not e2e"`` is the fast one; ``python -m pytest`` (what CI runs) adds the
tests marked ``e2e``, those that start a process, Ray, a browser or load the real model. The plugin
``tests/fast_tier.py`` fails an unmarked test that does any of that.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import socket
import sys
from pathlib import Path

import pytest


def _load_the_stages_blas() -> None:
    """Load the optimized BLAS a stage preloads (``stage_worker.model.blas``) into this test process, before MLX.

    Tests that compute with the real model in this process (engines, pipelines on threads, mlx-lm's own
    generation as the reference) would otherwise run on MLX's reference BLAS, several times slower than the
    stages they stand for. Loaded with ``RTLD_GLOBAL`` before MLX, its CBLAS symbols are the ones MLX binds to,
    as ``LD_PRELOAD`` does for a stage.
    """
    if "mlx.core" in sys.modules:
        return  # too late to take MLX's BLAS calls
    from stage_worker.model.blas import find_optimized_blas

    library = find_optimized_blas()
    if library is None:
        return
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


# The suite's workers run their tests' processes side by side on the same cores: every stage a test starts is on
# a shared host, so its idle OpenBLAS threads sleep at once, as a stage's do where other stages share its host
# (``stage_worker.model.blas``), instead of spinning for the next call on cores another test needs.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# For the same reason each BLAS computes on one thread: two workers' stages and in-process models share two cores,
# which is the product's own rule for stages sharing a host (``threads_for_load``: the cores split between them).
# OpenBLAS splits a GEMM's rows and columns between threads, never its sums, so the numbers are the same. Both
# settings cut the suite's busy CPU-seconds (README, "Contributing", has the figures).
os.environ.setdefault("STAGEMESH_BLAS_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_load_the_stages_blas()


def _compile_the_project() -> None:
    """Write the bytecode of the project's packages once, so each process the suite starts reads it.

    pip installs the project editable and compiles none of it, and where ``PYTHONDONTWRITEBYTECODE`` is set no
    process writes it either: every stage, serve, StageHost actor and CLI call would compile the modules it
    imports (0.1-0.25 CPU-s each, hundreds of processes). ``compileall`` writes regardless, skips what is
    current and touches nothing but ``__pycache__``."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("stagemesh", "stagemesh_core", "stage_worker", "coordinator", "gateway"):
        compileall.compile_dir(root / package, quiet=1)


_compile_the_project()

pytest_plugins = ("tests.fast_tier", "tests.worker_groups", "pytester")

# Each call hands out a fresh range so tests (and reruns) never share ports. The range sits
# between Ray's worker ports (10002-19999) and Linux's ephemeral ports (32768-60999), where an
# outgoing connection's TIME_WAIT could otherwise hold a port we want to bind. Under pytest-xdist
# each worker takes its own slice of it, so two workers never hand out the same port (a serve
# binds its ports a while after they were found free, and the soak's "block" fault firewalls
# ports it was given: neither may touch another worker's test).
_FIRST, _LAST = 22000, 32700
_STRIDE = 40  # the most consecutive ports one call hands out


def _worker_slice(first: int, last: int) -> tuple[int, int]:
    """[first, last) of this process's ports: the whole range, or its worker's share under pytest-xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... in an xdist worker
    if worker is None:
        return first, last
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    index = int(worker.removeprefix("gw"))
    width = (last - first) // count
    return first + index * width, first + (index + 1) * width


def _bases() -> itertools.cycle:
    """Range starts within this process's slice, from a pid-dependent point (a rerun starts elsewhere, away
    from the last run's TIME_WAIT), wrapping round: each one is checked free before it is handed out."""
    first, last = _worker_slice(_FIRST, _LAST)
    starts = list(range(first, last - _STRIDE + 1, _STRIDE))
    offset = os.getpid() % len(starts)
    return itertools.cycle(starts[offset:] + starts[:offset])


_NEXT_BASE = _bases()


def free_port_base(count: int) -> int:
    """A base port such that ``count`` consecutive loopback ports are free now."""
    if not 0 < count <= _STRIDE:
        raise ValueError(f"free_port_base hands out 1 to {_STRIDE} ports at a time, not {count}")
    for _ in range(200):
        base = next(_NEXT_BASE)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range on loopback")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from stage_worker.checkpoint.default_model import resolve_model_path

    return resolve_model_path(None)


# A llama small enough for CPU tests; with ``--load-format dummy`` its config.json is the whole model.
TINY_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 512,
    "max_position_embeddings": 256, "tie_word_embeddings": True,
}


def tiny_config(path: Path, **overrides) -> str:
    """A directory holding only a Hugging Face config.json (``TINY_CONFIG`` with ``overrides``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return str(path)
