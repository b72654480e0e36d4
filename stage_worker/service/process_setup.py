"""What a stage process does before MLX loads: read its launch, pin its cores, take its GPU, preload a fast BLAS,
and set MLX's CUDA backend the way serving wants it.

Only the standard library and the core are imported here, because ``LD_PRELOAD`` and ``CUDA_VISIBLE_DEVICES``
must be in place before MLX loads (see ``stage_worker.model.blas`` and ``stagemesh_core.gpus``). ``prepare`` does it
all and re-executes the process (same pid) with the BLAS preloaded; ``pinned_cores``, ``gpu_environment``,
``blas_threads`` and ``serving_mlx_environment`` are its pure parts. A bad setting exits ``ExitCode.CONFIG``
naming the variable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from stage_worker.model.blas import reexec_with_optimized_blas, usable_cores
from stagemesh_core import settings
from stagemesh_core.errors import UserError
from stagemesh_core.gpus import stage_gpu_environment
from stagemesh_core.plan import StageLaunch
from stagemesh_core.states import ExitCode


def blas_threads(env: Mapping[str, str], cores: int) -> int:
    """Size of this stage's BLAS thread pool: every core it may use, or ``STAGEMESH_BLAS_THREADS``."""
    return settings.read("BLAS_THREADS", env) or max(1, cores)


# MLX CUDA settings for serving: two features that suit a fixed batch shape but not serving, where every
# step's batch differs. A value already in the environment wins; they do nothing on Metal or the CPU.
# - MLX_CUDA_USE_CUDNN_SDPA=0: cuDNN attention builds an execution plan for every new (query, key) shape, and
#   a prompt batch almost always has a new one; MLX's own kernels need no plan. An LRU of 256 plans also
#   aborts the process once it has missed 512 times.
# - MLX_USE_CUDA_GRAPHS=0: graphs are captured and cached by the order of a batch's operations, which changes
#   with its composition (fresh prompts, a decode group, continued chunks), so serving mostly pays for capture
#   and instantiation without replaying.
# docs/performance.md ("MLX's CUDA settings") has the figures.
SERVING_MLX_CUDA_DEFAULTS: dict[str, str] = {"MLX_CUDA_USE_CUDNN_SDPA": "0", "MLX_USE_CUDA_GRAPHS": "0"}


def serving_mlx_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The MLX CUDA variables to set before MLX first runs on the GPU (pure): the defaults ``env`` lacks."""
    return {name: value for name, value in SERVING_MLX_CUDA_DEFAULTS.items() if name not in env}


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

    A stage the coordinator gave one GPU of a multi-GPU node sees only that one (unless
    ``STAGEMESH_GPU_PER_STAGE=off``). The BLAS pool is sized to the cores this process may use (after
    ``STAGEMESH_PIN_CORES``); the stage later shrinks the pool while co-located stages compute at once
    (``STAGEMESH_BLAS_THREADS`` fixes it).
    """
    try:
        launch = read_launch(launch_path)
        cores = pinned_cores(launch, os.environ, os.cpu_count() or 1)
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)  # inherited across the exec below
        threads = blas_threads(os.environ, usable_cores())
        os.environ.update(gpu_environment(launch, os.environ))  # inherited across the exec below
        os.environ.update(serving_mlx_environment(os.environ))
    except (ValueError, OSError, KeyError, TypeError) as exc:
        print(f"{module}: {exc}", file=sys.stderr)
        sys.exit(ExitCode.CONFIG)  # a setting to change, not a crash to restart
    reexec_with_optimized_blas(["-m", module, *argv], threads, shared_host=launch.stages_sharing_host() > 1)
    return launch
