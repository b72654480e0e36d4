"""Start a plan's stage processes from launch files and wait until the entry stage serves (test helper)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh_core.plan import PipelinePlan, StageLaunch, StageOptions


def start_stages(plan: PipelinePlan, options: StageOptions, workdir: Path, token: str,
                 timeout_s: float = 300) -> list[subprocess.Popen]:
    """One ``python -m stage_worker`` per rank (logs in ``workdir/stage-R.log``), returned once rank 0's
    gRPC health says SERVING; a stage that exits or a mesh that stays down fails the test with the logs."""
    ranks = range(len(plan.stages))
    for r in ranks:
        (workdir / f"launch-{r}.json").write_text(StageLaunch(plan, r, options, mesh_token=token).to_json())
    procs = [subprocess.Popen([sys.executable, "-m", "stage_worker", "--launch", str(workdir / f"launch-{r}.json")],
                              stdout=open(workdir / f"stage-{r}.log", "w"), stderr=subprocess.STDOUT)
             for r in ranks]
    with grpc.insecure_channel(f"127.0.0.1:{plan.stages[0].grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                    return procs
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, (workdir / "stage-0.log").read_text()
            assert all(p.poll() is None for p in procs), [(workdir / f"stage-{r}.log").read_text() for r in ranks]
            time.sleep(0.3)
