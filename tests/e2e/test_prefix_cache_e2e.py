"""Prefix caching across a real pipeline (stage processes, lanes, gRPC, no Ray): at PP=3 (an entry, a middle
and a last stage) greedy output with the cache on equals the cache off, and every stage reused exactly what
the entry stage decided."""

from __future__ import annotations

import subprocess
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from stagemesh_core.mesh_token import call_metadata, generate_token
from stagemesh_core.plan import StageOptions, make_local_plan
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import free_port_base
from tests.e2e.stage_processes import start_stages
from tests.stage_calls import generate
from tests.test_prefix_cache_engine import BLOCK, _conversation, conversation_without_cache

TOKEN = generate_token()  # the stages' gRPC requires the mesh token on GenerateStream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cache_off_outputs(default_model_path):
    """The conversation without a prefix cache, one stage in this process (PP=N is bit-identical to
    PP=1: tests/e2e/test_pipeline_e2e.py)."""
    return conversation_without_cache(default_model_path)


class _GrpcClient:
    """``_Engine``'s interface over a running pipeline's gRPC (a GenerateStream call per prompt)."""

    def __init__(self, stub) -> None:
        self._stub = stub
        self._pool = ThreadPoolExecutor(4)

    def submit(self, prompt, max_tokens=6) -> Future:
        return self._pool.submit(self.generate, prompt, max_tokens)

    @staticmethod
    def tokens(handle: Future) -> list[int]:
        return handle.result(timeout=300)

    def generate(self, prompt, max_tokens=6) -> list[int]:
        request = stage_pb2.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=list(prompt),
                                            max_tokens=max_tokens, ignore_eos=True)
        return generate(self._stub, request, metadata=call_metadata(TOKEN))


def _start(default_model_path, workdir, pp):
    plan = make_local_plan(default_model_path, 30, pp, "auto", ring_base_port=free_port_base(2 * pp),
                           grpc_base_port=free_port_base(pp))
    options = StageOptions(max_num_seqs=8, max_model_len=512, prefix_cache_block_size=BLOCK)
    procs = start_stages(plan, options, workdir, TOKEN)
    channels = [grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") for s in plan.stages]
    return procs, channels


# PP=3 only: each kind of stage is in it, and PP=2 (an entry and a last stage) would add no other.
def test_greedy_output_with_the_cache_equals_without_and_every_stage_agrees(
        default_model_path, tmp_path, cache_off_outputs):
    procs, channels = _start(default_model_path, tmp_path, 3)
    try:
        assert _conversation(_GrpcClient(stage_pb2_grpc.StageStub(channels[0]))) == cache_off_outputs
        stats = [stage_pb2_grpc.StageStub(c).GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10).stats
                 for c in channels]
    finally:
        procs[0].terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for c in channels:
            c.close()
    hits = {s.prefix_cache_hits for s in stats}
    queries = {s.prefix_cache_queries for s in stats}
    assert len(hits) == 1 and len(queries) == 1, stats  # every stage copied exactly the same positions
    assert hits.pop() >= 32 + 24 + 16 + 8 + 32 + 40
    assert all(s.prefix_cache_blocks > 0 for s in stats)
