"""Serving behaviour of a real pipeline (stage processes over the ring, gRPC, no Ray): batched
generation equals one-at-a-time at temperature 0, a full stage answers RESOURCE_EXHAUSTED at
once, and idle or waiting stages do not burn CPU."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import grpc
import psutil
import pytest

from stagemesh.core.mesh_token import call_metadata, generate_token
from stagemesh.core.plan import StageOptions, make_local_plan
from stagemesh.core.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import free_port_base
from tests.e2e.stage_processes import start_stages

pytestmark = pytest.mark.e2e

TOKEN = generate_token()
PROMPTS = [[504, 3575, 282, 4649 + i, 314] for i in range(8)]


@pytest.fixture(scope="module")
def pipeline(default_model_path, tmp_path_factory):
    """PP=2 stage processes serving gRPC, small queue bounds so overload is easy to provoke."""
    workdir = tmp_path_factory.mktemp("pp2-serving")
    plan = make_local_plan(default_model_path, 30, 2, "auto", ring_base_port=free_port_base(4),
                           grpc_base_port=free_port_base(2))
    options = StageOptions(max_num_seqs=8, max_waiting=2, max_model_len=512)
    procs = start_stages(plan, options, workdir, TOKEN, timeout_s=120)
    channel = grpc.insecure_channel(f"127.0.0.1:{plan.stages[0].grpc_port}")
    yield stage_pb2_grpc.StageStub(channel), procs
    procs[0].terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    channel.close()


def _generate(stub, prompt, max_tokens=16):
    tokens = []
    for reply in stub.Generate(stage_pb2.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                                         max_tokens=max_tokens, ignore_eos=True), timeout=300,
                             metadata=call_metadata(TOKEN)):
        tokens += list(reply.token_ids)
    return tokens


def test_concurrent_greedy_generations_equal_one_at_a_time(pipeline):
    stub, _ = pipeline
    alone = [_generate(stub, p) for p in PROMPTS[:4]]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _generate(stub, PROMPTS[i])))
               for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [together[i] for i in range(4)] == alone


def test_a_full_stage_refuses_at_once_with_resource_exhausted(pipeline):
    stub, _ = pipeline
    results: list[str] = []

    def run():
        try:
            _generate(stub, PROMPTS[0], max_tokens=40)
            results.append("ok")
        except grpc.RpcError as exc:
            results.append(exc.code().name + ":" + exc.details())

    threads = [threading.Thread(target=run) for _ in range(14)]  # 8 running + 2 waiting fit
    [t.start() for t in threads]
    [t.join() for t in threads]
    refused = [r for r in results if r.startswith("RESOURCE_EXHAUSTED")]
    assert results.count("ok") == 10 and len(refused) == 4
    assert "--max-num-seqs 8" in refused[0] and "--max-waiting 2" in refused[0]


def test_idle_stages_do_not_spin(pipeline):
    _, procs = pipeline
    stages = [psutil.Process(p.pid) for p in procs]
    before = [sum(s.cpu_times()[:2]) for s in stages]
    time.sleep(3)
    burned = [sum(s.cpu_times()[:2]) - b for s, b in zip(stages, before)]
    assert all(b < 0.5 for b in burned), burned  # a spinning ring receive would burn ~3 s each
