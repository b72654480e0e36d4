"""``python -m stage_worker --plan PLAN.json --rank R [...]``: start one stage, with a fast BLAS.

Only the standard library is imported before the BLAS decision, because
``LD_PRELOAD`` must be in place before MLX loads (see ``stage_worker.blas``);
then it runs ``stage_worker.stage_process``. The BLAS pool is sized to the
cores this process may use (after ``STAGEMESH_PIN_CORES``); the stage shrinks
it while co-located stages compute at once (``STAGEMESH_BLAS_THREADS`` fixes it).
"""

from __future__ import annotations

import json
import os
import sys

from stage_worker.blas import fixed_threads, reexec_with_optimized_blas, usable_cores


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def stages_on_host(argv: list[str]) -> int:
    """Stages of this pipeline on this stage's host (``--stages-on-host``, else from the plan)."""
    sharing = _flag(argv, "--stages-on-host")
    if sharing and int(sharing) > 0:
        return int(sharing)
    try:
        plan = json.loads(open(_flag(argv, "--plan") or "").read())
        me = plan["stages"][int(_flag(argv, "--rank") or 0)]
        return sum(1 for s in plan["stages"] if s["host"] == me["host"])
    except (OSError, ValueError, KeyError, IndexError):
        return 1


def blas_threads(env: dict[str, str], cores: int) -> int:
    """Size of this stage's BLAS thread pool: every core it may use, or ``STAGEMESH_BLAS_THREADS``.

    The stage then resizes the pool with the pipeline's load (``blas.AdaptiveBlasThreads``).
    """
    return fixed_threads(env) or max(1, cores)


PIN_ENV = "STAGEMESH_PIN_CORES"


def pinned_cores(argv: list[str], env: dict[str, str], cpus: int) -> set[int] | None:
    """Cores to pin this stage to: ``STAGEMESH_PIN_CORES`` is a core list ("0,1") or
    ``per-stage`` (global stage g on core g mod cpus); unset means no pinning."""
    setting = env.get(PIN_ENV, "").strip()
    if not setting:
        return None
    if setting == "per-stage":
        try:
            plan = json.loads(open(_flag(argv, "--plan") or "").read())
            index = plan["stages"][int(_flag(argv, "--rank") or 0)]["global_index"]
        except (OSError, ValueError, KeyError, IndexError):
            return None
        return {index % cpus}
    try:
        return {int(c) for c in setting.split(",") if c.strip()}
    except ValueError:
        raise ValueError(f"{PIN_ENV}={setting!r} must be a comma-separated core list (e.g. 0,1) "
                         f"or per-stage") from None


if __name__ == "__main__":
    argv = sys.argv[1:]
    try:
        cores = pinned_cores(argv, dict(os.environ), os.cpu_count() or 1)
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)  # inherited across the exec below
        threads = blas_threads(dict(os.environ), usable_cores())
    except (ValueError, OSError) as exc:
        print(f"stage_worker: {exc}", file=sys.stderr)
        sys.exit(2)  # EXIT_CONFIG: a setting to change, not a crash to restart
    reexec_with_optimized_blas(["-m", "stage_worker", *argv], threads, shared_host=stages_on_host(argv) > 1)
    from stage_worker.stage_process import main

    sys.exit(main())
