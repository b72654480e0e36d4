"""A stand-in for ``python -m stage_worker`` (a serving stage) that loads no model.

It reads the real ``--launch`` file (plan, rank, options), holds its plan's ring, lane and gRPC ports on its
plan's host, serves ``grpc.health.v1.Health`` (NOT_SERVING while "loading",
then SERVING) and ``stagemesh.v1.Stage/GetStageInfo``, and exits 0 on SIGTERM.
Test-only flags, given before ``--launch`` in the coordinator's stage command,
make it misbehave: ``--fake-exit-code`` (exit with that code
after loading), ``--fake-fail-rank`` (only that rank misbehaves),
``--fake-load-s``. Lets coordinator tests run in seconds without MLX.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from stagemesh_core.plan import PipelinePlan, StageLaunch
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc


class _Stage(stage_pb2_grpc.StageServicer):
    def __init__(self, plan: PipelinePlan, rank: int, node_id: str) -> None:
        self.plan, self.rank, self.node_id = plan, rank, node_id
        self.state = stage_pb2.STAGE_STATE_LOADING

    def GetStageInfo(self, request, context):
        me = self.plan.stages[self.rank]
        return stage_pb2.StageInfo(
            replica=self.plan.replica, rank=self.rank, world_size=self.plan.size,
            layer_start=me.layers.start, layer_end=me.layers.end, num_layers=self.plan.num_layers,
            host=me.host, grpc_port=me.grpc_port, ring_port=me.ring_port, lane_port=me.lane_port,
            pid=os.getpid(), node_id=self.node_id, model=self.plan.model_path, compute_dtype="float32",
            quantized=True, state=self.state, stats=stage_pb2.StageStats(batches=7, tokens=11), backend="cpu",
            device="fake CPU",
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch", required=True)
    parser.add_argument("--fake-load-s", type=float, default=0.3)
    parser.add_argument("--fake-exit-code", type=int)
    parser.add_argument("--fake-fail-rank", type=int)
    args = parser.parse_args()
    launch = StageLaunch.from_json(open(args.launch).read())
    plan, me, args.rank = launch.plan, launch.me, launch.rank
    print(f"fake stage {args.rank}/{plan.size} pid {os.getpid()} layers {me.layers} on {me.host} "
          f"grpc :{me.grpc_port} ring :{me.ring_port} lane :{me.lane_port} args {sys.argv[1:]}", flush=True)

    held = []
    for port in (me.ring_port, me.lane_port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((me.host, port))
        sock.listen(1)
        held.append(sock)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    stage = _Stage(plan, args.rank, launch.options.node_id)
    stage_pb2_grpc.add_StageServicer_to_server(stage, server)
    server.add_insecure_port(f"{me.host}:{me.grpc_port}")
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    time.sleep(args.fake_load_s)
    misbehave = args.fake_fail_rank is None or args.fake_fail_rank == args.rank
    if args.fake_exit_code is not None and misbehave:
        print(f"fake stage {args.rank}: failing with exit code {args.fake_exit_code}", flush=True)
        return args.fake_exit_code
    stage.state = stage_pb2.STAGE_STATE_SERVING
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"fake stage {args.rank}: serving", flush=True)
    done.wait()
    print(f"fake stage {args.rank}: stopping", flush=True)
    server.stop(0.5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
