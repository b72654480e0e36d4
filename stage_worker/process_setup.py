"""What a stage process does before MLX loads: read its launch, pin its cores, take its GPU, preload a fast BLAS.

Only the standard library and the core are imported here, because
``LD_PRELOAD`` and ``CUDA_VISIBLE_DEVICES`` must be in place before MLX loads
(see ``stage_worker.blas`` and ``stagemesh.core.gpus``). A stage the
coordinator gave one GPU of a multi-GPU node sees only that one (unless
``STAGEMESH_GPU_PER_STAGE=off``); ``prepare`` then re-executes the process
(same pid) with the BLAS preloaded, sized
to the cores this process may use (after ``STAGEMESH_PIN_CORES``); the stage
later shrinks the pool while co-located stages compute at once
(``STAGEMESH_BLAS_THREADS`` fixes it). A bad setting exits
``ExitCode.CONFIG`` naming the variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from stage_worker.blas import reexec_with_optimized_blas, usable_cores
from stagemesh.core import settings
from stagemesh.core.errors import UserError
from stagemesh.core.gpus import stage_gpu_environment
from stagemesh.core.plan import StageLaunch
from stagemesh.core.states import ExitCode


def blas_threads(env: Mapping[str, str], cores: int) -> int:
    """Size of this stage's BLAS thread pool: every core it may use, or ``STAGEMESH_BLAS_THREADS``."""
    return settings.read("BLAS_THREADS", env) or max(1, cores)


def pinned_cores(launch: StageLaunch, env: Mapping[str, str], cpus: int) -> set[int] | None:
    """Cores to pin this stage to: ``STAGEMESH_PIN_CORES`` is a core list ("0,1") or
    ``per-stage`` (global stage g on core g mod cpus); unset means no pinning."""
    setting = (settings.read("PIN_CORES", env) or "").strip()
    if not setting:
        return None
    if setting == "per-stage":
        return {launch.me.global_index % cpus}
    try:
        return {int(c) for c in setting.split(",") if c.strip()}
    except ValueError:
        raise UserError(f"{settings.env_name('PIN_CORES')}={setting!r} must be a comma-separated core list "
                        f"(e.g. 0,1) or per-stage") from None


def gpu_environment(launch: StageLaunch, env: Mapping[str, str]) -> dict[str, str]:
    """Variables that narrow this stage to its GPU (``StageOptions.gpu_index``); empty when it keeps the node's."""
    return stage_gpu_environment(launch.options.gpu_index, settings.read("GPU_PER_STAGE", env), env)


def launch_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--launch", required=True, help="the stage's launch JSON (plan, rank, options)")
    return parser


def read_launch(path: str) -> StageLaunch:
    with open(path) as f:
        return StageLaunch.from_json(f.read())


def prepare(module: str, argv: Sequence[str], launch_path: str) -> StageLaunch:
    """Read the launch, pin cores, take the stage's GPU, and re-execute ``python -m module argv`` with a fast
    BLAS if there is one.

    Returns the launch once this process is the one that should run (after the re-exec, or when
    there is nothing to preload); exits ``ExitCode.CONFIG`` on a bad setting or launch file.
    """
    try:
        launch = read_launch(launch_path)
        cores = pinned_cores(launch, os.environ, os.cpu_count() or 1)
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)  # inherited across the exec below
        threads = blas_threads(os.environ, usable_cores())
        os.environ.update(gpu_environment(launch, os.environ))  # inherited across the exec below
    except (ValueError, OSError, KeyError, TypeError) as exc:
        print(f"{module}: {exc}", file=sys.stderr)
        sys.exit(ExitCode.CONFIG)  # a setting to change, not a crash to restart
    reexec_with_optimized_blas(["-m", module, *argv], threads, shared_host=launch.stages_sharing_host() > 1)
    return launch
