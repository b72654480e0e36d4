"""Serving behaviour of a real pipeline (stage processes over the ring, gRPC, no Ray): batched
generation equals one-at-a-time at temperature 0, a full stage answers RESOURCE_EXHAUSTED at
once, idle or waiting stages do not burn CPU, and ``GenerateStream`` with many prompts on one call (the
gateway's way) gives each prompt what a call of its own gives it, errors and cancellations per prompt."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
import uuid

import grpc
import psutil
import pytest

from stagemesh_core.mesh_token import call_metadata, generate_token
from stagemesh_core.plan import StageOptions, make_local_plan
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc
from tests.conftest import free_port_base
from tests.coordinator.helpers import wait_until
from tests.e2e.stage_processes import start_stages
from tests.stage_calls import generate

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
    """One prompt on a call of its own."""
    request = stage_pb2.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, max_tokens=max_tokens,
                                        ignore_eos=True)
    return generate(stub, request, metadata=call_metadata(TOKEN))


def test_concurrent_greedy_generations_equal_one_at_a_time(pipeline):
    stub, _ = pipeline
    # Eight tokens a request: seven decode steps of the four running together, each compared with alone.
    alone = [_generate(stub, p, max_tokens=8) for p in PROMPTS[:4]]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, _generate(stub, PROMPTS[i], max_tokens=8)))
               for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [together[i] for i in range(4)] == alone


def test_a_full_stage_refuses_at_once_with_resource_exhausted(pipeline):
    stub, _ = pipeline
    results: list[str] = []

    def run():
        try:
            _generate(stub, PROMPTS[0], max_tokens=12)
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


class _Requests:
    """The client's side of a GenerateStream call: put messages, ``close()`` to end it."""

    def __init__(self) -> None:
        self._queue: queue.Queue[stage_pb2.GenerateStreamRequest | None] = queue.Queue()

    def start(self, prompt: list[int], request_id: str | None = None, max_tokens: int = 16,
              **sampling: float) -> str:
        request_id = uuid.uuid4().hex if request_id is None else request_id
        self._queue.put(stage_pb2.GenerateStreamRequest(start=stage_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
            sampling=stage_pb2.SamplingParams(**sampling))))
        return request_id

    def cancel(self, request_id: str) -> None:
        self._queue.put(stage_pb2.GenerateStreamRequest(cancel=request_id))

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        while (message := self._queue.get()) is not None:
            yield message


def _stream(stub, requests: _Requests):
    return stub.GenerateStream(iter(requests), timeout=300, metadata=call_metadata(TOKEN))


def _running(stub) -> int:
    return stub.GetStageInfo(stage_pb2.GetStageInfoRequest(), timeout=10).stats.running_sequences


def test_prompts_sharing_one_call_get_what_a_call_of_their_own_gives_them(pipeline):
    stub, _ = pipeline
    alone = [_generate(stub, p) for p in PROMPTS[4:8]]
    requests = _Requests()
    ids = [requests.start(p) for p in PROMPTS[4:8]]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finished: set[str] = set()
    widest = 0
    for message in _stream(stub, requests):
        widest = max(widest, len(message.updates))
        for update in message.updates:
            assert not update.error_code, update.error_message
            tokens[update.request_id] += list(update.response.token_ids)
            if update.response.finish_reason:
                assert update.response.finish_reason == stage_pb2.FINISH_REASON_LENGTH
                finished.add(update.request_id)
        if finished == set(ids):
            requests.close()
    assert [tokens[i] for i in ids] == alone
    assert widest > 1  # one message carried several prompts' tokens of one step


def test_a_bad_prompt_fails_alone_and_the_others_on_the_call_finish(pipeline):
    stub, _ = pipeline
    requests = _Requests()
    good = requests.start(PROMPTS[0])
    bad = requests.start(PROMPTS[1], temperature=5.0)
    requests.start(PROMPTS[2], request_id="")
    outcome: dict[str, str] = {}
    for message in _stream(stub, requests):
        for update in message.updates:
            if update.error_code:
                outcome[update.request_id] = f"{grpc.StatusCode.INVALID_ARGUMENT.value[0] == update.error_code}:" \
                                             f"{update.error_message}"
            elif update.response.finish_reason:
                outcome[update.request_id] = f"finished {update.response.completion_tokens}"
        if len(outcome) == 3:
            requests.close()
    assert outcome[good] == "finished 16"
    assert outcome[bad].startswith("True:") and "sampling.temperature" in outcome[bad]
    assert outcome[""].startswith("True:") and "request_id is required" in outcome[""]


def test_cancelling_a_prompt_or_the_whole_call_frees_its_sequences(pipeline):
    stub, _ = pipeline
    requests = _Requests()
    long_one = requests.start(PROMPTS[3], max_tokens=400)
    responses = _stream(stub, requests)
    seen_after_cancel: list[str] = []
    cancelled = False
    short = None
    for message in responses:
        ids = [u.request_id for u in message.updates]
        if cancelled:
            seen_after_cancel += ids
        elif long_one in ids:
            requests.cancel(long_one)
            cancelled = True
            short = requests.start(PROMPTS[4], max_tokens=4)
        if any(u.request_id == short and u.response.finish_reason for u in message.updates):
            break
    # The cancel raced at most one step already on its way; after that the long prompt is gone.
    assert seen_after_cancel.count(long_one) <= 1
    wait_until(lambda: _running(stub) == 0, 60, "the cancelled prompt freeing its sequence")

    another = requests.start(PROMPTS[5], max_tokens=400)
    for message in responses:
        if any(u.request_id == another for u in message.updates):
            break
    responses.cancel()  # the client gives up the whole call
    wait_until(lambda: _running(stub) == 0, 60, "cancelling the call freeing its prompt's sequence")


def test_a_full_stage_refuses_prompts_of_a_stream_with_resource_exhausted(pipeline):
    stub, _ = pipeline
    requests = _Requests()
    ids = [requests.start(PROMPTS[i % 8], max_tokens=12) for i in range(14)]  # 8 running + 2 waiting fit
    outcome: dict[str, str] = {}
    for message in _stream(stub, requests):
        for update in message.updates:
            if update.error_code:
                outcome[update.request_id] = f"{update.error_code}:{update.error_message}"
            elif update.response.finish_reason:
                outcome[update.request_id] = "ok"
        if len(outcome) == len(ids):
            requests.close()
    refused = [v for v in outcome.values() if v != "ok"]
    assert list(outcome.values()).count("ok") == 10 and len(refused) == 4
    assert refused[0].startswith(f"{grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}:") and "--max-num-seqs 8" in refused[0]
