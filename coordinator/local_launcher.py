"""Run one pipeline as local processes on this machine, supervised.

Starts every rank of a ``PipelinePlan`` as ``python -m stage_worker.service.harness``
(a stage that runs a fixed job instead of serving) at once (the ring needs all
ranks to come up together), each logging to its own file. If any rank exits
with an error, the others are stopped within a second and ``PipelineFailed``
names the rank, its exit code and the end of its log, so a dead or refused
stage never leaves the caller waiting. Used by the parity tool
and the tests; ``stagemesh serve`` places stages with Ray instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stagemesh_core.plan import PipelinePlan, StageLaunch, StageOptions

_POLL_S = 0.05


class PipelineFailed(RuntimeError):
    """A stage process failed; the message carries its rank, exit code and log tail."""

    def __init__(self, message: str, rank: int, returncode: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode


@dataclass
class StageProcess:
    rank: int
    process: subprocess.Popen
    log_path: Path
    member: int = 0  # its place in the stage's tensor-parallel group

    @property
    def name(self) -> str:
        return f"stage {self.rank}" + (f" worker {self.member}" if self.member else "")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalPipeline:
    """A started pipeline: its processes and the files they write."""

    plan: PipelinePlan
    workdir: Path
    stages: list[StageProcess] = field(default_factory=list)

    def path(self, name: str) -> Path:
        return self.workdir / name

    @property
    def pids(self) -> list[int]:
        return [s.process.pid for s in self.stages]

    def wait(self, timeout_s: float) -> None:
        """Wait until every stage exits 0; on the first failure stop the rest and raise."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = False
            for stage in self.stages:
                code = stage.process.poll()
                if code is None:
                    running = True
                elif code != 0:
                    self.stop()
                    raise PipelineFailed(
                        f"{stage.name} exited with code {code}:\n{stage.log_tail()}",
                        stage.rank, code,
                    )
            if not running:
                return
            if time.monotonic() > deadline:
                self.stop()
                tails = "\n".join(f"--- {s.name}\n{s.log_tail(5)}" for s in self.stages)
                raise PipelineFailed(f"pipeline did not finish within {timeout_s:.0f} s\n{tails}", -1, None)
            time.sleep(_POLL_S)

    def stop(self, grace_s: float = 1.0) -> None:
        for stage in self.stages:
            if stage.process.poll() is None:
                stage.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for stage in self.stages:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                stage.process.wait(remaining)
            except subprocess.TimeoutExpired:
                stage.process.kill()
                stage.process.wait()


def start_local_pipeline(
    plan: PipelinePlan,
    *,
    job: dict | None = None,
    record_logits: bool = False,
    stats: bool = False,
    options: StageOptions | Sequence[StageOptions] | None = None,
    env: dict[str, str] | None = None,
    workdir: str | None = None,
) -> LocalPipeline:
    """Start every rank of ``plan`` (every worker of each tensor-parallel group) with ``options`` (one for all, or
    one per rank)."""
    if options is None or isinstance(options, StageOptions):
        per_rank = [options or StageOptions()] * plan.size
    else:
        per_rank = list(options)
    if len(per_rank) != plan.size:
        raise ValueError(f"{len(per_rank)} stage options for a pipeline of {plan.size} stages")
    root = Path(workdir or tempfile.mkdtemp(prefix="stagemesh-pipeline-"))
    root.mkdir(parents=True, exist_ok=True)
    if job is not None:
        (root / "job.json").write_text(json.dumps(job))
    pipeline = LocalPipeline(plan, root)
    child_env = {**os.environ, **(env or {})}
    for stage in plan.workers:
        # A group member's files carry its member number; worker 0's keep the stage's names.
        name = f"{stage.rank}" + (f"-{stage.member}" if stage.member else "")
        launch_path = root / f"launch-{name}.json"
        launch_path.write_text(StageLaunch(plan, stage.rank, per_rank[stage.rank], member=stage.member).to_json())
        args = [sys.executable, "-m", "stage_worker.service.harness", "--launch", str(launch_path)]
        leader = stage.member == 0
        if stage.rank == 0 and leader and job is not None:
            args += ["--job", str(root / "job.json"), "--job-result", str(root / "result.json")]
        if record_logits and stage.rank == plan.size - 1 and leader:
            args += ["--record-logits", str(root / "logits.npz")]
        if stats:
            args += ["--stats", str(root / f"stats-{name}.json")]
        log_path = root / f"stage-{name}.log"
        with open(log_path, "w") as log_file:
            process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=child_env)
        pipeline.stages.append(StageProcess(stage.rank, process, log_path, stage.member))
    return pipeline
