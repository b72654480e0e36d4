"""A stage run for tests, parity checks and benchmarks: a fixed job instead of a server.

``python -m stage_worker.service.harness --launch LAUNCH.json [--job JOB.json --job-result OUT.json]
[--record-logits LOGITS.npz] [--stats STATS.json]`` loads and connects exactly like
a serving stage (``stage_process.run_stage``) but serves no gRPC: rank 0 runs
the ``GenerationJob`` (if any) and stops the pipeline; the other ranks relay
until the SHUTDOWN message has gone round (a tensor-parallel group's members
follow their worker 0). The last rank can record the logits of every sampled
row; every rank can write its weight bytes and peak RSS.
``coordinator.local_launcher`` starts a whole pipeline of these.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from stage_worker.service.process_setup import launch_parser, prepare
from stagemesh_core.plan import StageLaunch


@dataclass(frozen=True)
class HarnessOptions:
    job: str | None = None  # GenerationJob JSON (rank 0)
    job_result: str | None = None  # where rank 0 writes the job's outputs
    record_logits: str | None = None  # last rank: every sampled row's logits (.npz)
    stats: str | None = None  # every rank: weight bytes and peak RSS on exit


def run(launch: StageLaunch, options: HarnessOptions) -> int:
    # MLX loads with these imports: only after ``prepare`` has preloaded the BLAS.
    from stage_worker.engine.generation_job import GenerationJob, run_generation
    from stage_worker.engine.stage_runtime import LogitRecorder
    from stage_worker.engine.stage_status import StageStatus
    from stage_worker.service.memory import peak_rss_bytes
    from stage_worker.service.stage_process import RunningStage, open_stage, run_member, run_relay, run_stage
    from stagemesh_core.states import ExitCode, StageState

    ctx = open_stage(launch)
    if ctx is None:
        return ExitCode.CONFIG
    status = StageStatus()
    recorder = LogitRecorder() if (options.record_logits and launch.is_last) else None
    weight_bytes = 0

    def body(stage: RunningStage) -> None:
        nonlocal weight_bytes
        weight_bytes = stage.loaded.model.weight_bytes
        if launch.is_member:
            run_member(stage, status)
            return
        if not launch.is_first:
            run_relay(stage, status)
            return
        pipeline = stage.entry_pipeline(status, speculating=False)
        status.set_state(StageState.SERVING)
        if options.job:
            with open(options.job) as f:
                job = GenerationJob.from_dict(json.load(f))
            _write_json(options.job_result, run_generation(pipeline, job).to_dict())
        pipeline.shutdown()

    code = run_stage(ctx, status, body, recorder)
    if code != ExitCode.OK:
        return code
    if recorder is not None and options.record_logits:
        recorder.save(options.record_logits)
    _write_json(options.stats, {"rank": launch.rank, "member": launch.member,
                                "layers": [launch.me.layers.start, launch.me.layers.end],
                                "weight_bytes": weight_bytes, "peak_rss_bytes": peak_rss_bytes()})
    return code


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f)


def main() -> int:
    argv = sys.argv[1:]
    parser = launch_parser("python -m stage_worker.service.harness", __doc__)
    parser.add_argument("--job", help="generation job JSON (rank 0 only)")
    parser.add_argument("--job-result", help="where rank 0 writes the job's outputs")
    parser.add_argument("--record-logits", help="last rank: save every sampled row's logits (.npz)")
    parser.add_argument("--stats", help="write weight bytes and peak RSS here on exit")
    args = parser.parse_args(argv)
    launch = prepare("stage_worker.service.harness", argv, args.launch)
    from stage_worker.model import lean_mlx_lm

    lean_mlx_lm.install()  # as a serving stage does (stage_worker.__main__)
    return run(launch, HarnessOptions(args.job, args.job_result, args.record_logits, args.stats))


if __name__ == "__main__":
    sys.exit(main())
