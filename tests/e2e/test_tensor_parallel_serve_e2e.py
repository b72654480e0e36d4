"""``stagemesh serve -tp 2 -pp 2``: four worker processes under real Ray, two MLX groups, the real default model.

The default model (9 attention heads over 3 KV heads) is cut unevenly: each stage's worker 0 holds 2 KV
heads, worker 1 one. Greedy completions through the OpenAI SDK, sent together so they batch, equal the
tokens of one process computing the whole model (the harness at -tp 1, -pp 1) over their first 48 tokens, and
so do one stream with prompt lookup speculating (its proposals taken) and a repeated prompt restored from the
prefix cache;
/mesh and /metrics show every worker; a killed worker 1 fails what is in flight at once, brings its replica
back, and the healed mesh answers the same tokens. Then serve stops clean, leaving no worker or port behind.
Also: the bad inputs of -tp, refused before anything starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from coordinator.local_launcher import start_local_pipeline
from stagemesh_core.plan import make_local_plan
from tests.conftest import free_port_base
from tests.e2e.serve_process import assert_stops_clean, start_serve

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colours are",
           # Repeats itself, so prompt lookup's proposals are taken (test_a_group_speculates_...).
           "Count with me: 1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3"]
SPECULATION = '{"method": "ngram", "num_speculative_tokens": 4}'  # off while more than 4 sequences run
TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(read_model_spec(default_model_path))


@pytest.fixture(scope="module")
def reference(default_model_path, tokenizer, tmp_path_factory):
    """Each prompt's greedy tokens from one process holding the whole model (-tp 1 -pp 1)."""
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    workdir = tmp_path_factory.mktemp("tp1")
    plan = make_local_plan(default_model_path, 30, 1, "auto", ring_base_port=free_port_base(2))
    pipeline = start_local_pipeline(plan, job={"prompts": prompts, "max_tokens": TOKENS}, workdir=str(workdir))
    pipeline.wait(300)
    return prompts, json.loads((workdir / "result.json").read_text())["outputs"]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    serve = start_serve(tmp_path_factory.mktemp("serve-tp2-pp2"), "--speculative-config", SPECULATION, pp=2, tp=2,
                        timeout=300)
    yield serve
    serve.stop()


def _complete_all(serve, prompts: list[list[int]]) -> list[str]:
    """Every prompt (token ids) at once, so they batch; greedy, EOS ignored; each completion's text, checked to
    be ``TOKENS`` tokens long."""
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def one(prompt: list[int]) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == TOKENS
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _texts(tokenizer, outputs: list[list[int]]) -> list[str]:
    return [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]


def test_tp2_pp2_serves_the_tokens_of_one_process_batched(serve, reference, tokenizer):
    prompts, expected = reference
    assert _complete_all(serve, prompts) == _texts(tokenizer, expected)


def test_a_group_speculates_with_the_tokens_of_one_process(serve, reference, tokenizer):
    # One stream: prompt lookup proposes, worker 0 of each group verifies several rows in one trip, its member
    # computes the same rows on its heads and rolls back what was rejected with it.
    prompts, expected = reference
    assert _complete_all(serve, prompts[-1:]) == _texts(tokenizer, expected[-1:])
    # The counts are each stage's status as the gateway last polled it: read until the stream's shows.
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        accepted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("stagemesh_stage_spec_decode_num_accepted_tokens_total{")
                    and 'worker="0"' in line and 'rank="0"' in line]
        if (accepted and accepted[0] > 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert accepted and accepted[0] > 0, accepted


def test_a_repeated_prompt_restores_its_blocks_on_every_worker(serve, reference, tokenizer):
    # The prefix cache at -tp: worker 0 decides what is restored, and its member restores the same blocks of its
    # own KV heads; a member that computed from other keys and values would change the tokens.
    prompts, expected = reference
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    replies = [client.completions.create(model=model, prompt=prompts[-1], max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}) for _ in range(2)]
    cached = replies[-1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached < len(prompts[-1]), (cached, len(prompts[-1]))
    assert [r.choices[0].text for r in replies] == _texts(tokenizer, expected[-1:]) * 2


def test_every_worker_is_in_the_mesh_and_the_metrics(serve):
    (replica,) = serve.mesh()["replicas"]
    workers = [(s["rank"], s["member"]) for s in replica["stages"]]
    assert workers == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["healthy"] and s["state"] == "serving" for s in replica["stages"])
    assert len({s["grpc_port"] for s in replica["stages"]}) == 4
    # A member computes every batch its worker 0 computes. The stages' counts are read from each one's status
    # as the gateway last polled it, so a batch that just ran (the release after the last request) may be in
    # one member's count before its leader's: read until the mesh is quiet and the two agree, for a while.
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        batches = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                   for line in metrics.splitlines() if line.startswith("stagemesh_stage_batches_total{")}
        pairs = [(batches[f'host="127.0.0.1",rank="{rank}",replica="0",worker="0"'],
                  batches[f'host="127.0.0.1",rank="{rank}",replica="0",worker="1"']) for rank in (0, 1)]
        if all(leader == member for leader, member in pairs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for leader, member in pairs:
        assert leader > 0 and member == leader, pairs


def test_a_killed_worker_fails_requests_in_flight_and_its_group_heals(serve, reference, tokenizer):
    prompts, expected = reference
    (replica,) = serve.mesh()["replicas"]
    member = next(s for s in replica["stages"] if (s["rank"], s["member"]) == (1, 1))
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=4000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # generating
    os.kill(member["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in stream:
            pass
    assert time.monotonic() - started < 15
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        mesh = serve.mesh()
        stages = mesh["replicas"][0]["stages"]
        if mesh["replicas"][0]["restarts"] >= 1 and all(s["healthy"] for s in stages) and \
                member["pid"] not in [s["pid"] for s in stages]:
            break
        time.sleep(1)
    else:
        pytest.fail(f"the group did not heal:\n{serve.log()[-3000:]}")
    assert all(psutil.pid_exists(s["pid"]) for s in stages)
    assert _complete_all(serve, prompts[:2]) == _texts(tokenizer, expected[:2])


def test_serve_stops_clean(serve):
    assert_stops_clean(serve, "sigterm-to-serve")


@pytest.mark.parametrize(("flags", "says"), [
    (["-tp", "4"], "-tp 4 needs at least 4 KV heads"),
    (["-tp", "0"], "--tensor-parallel-size must be at least 1"),
    (["-tp", "2", "--hop-transport", "ring"], "use --hop-transport lane with -tp"),
    (["-tp", "2", "--tp-backend", "jaccl"], "--tp-backend jaccl is not available"),
    (["-tp", "2", "--tp-backend", "nccl"], "--tp-backend nccl is not available"),
])
def test_bad_tensor_parallel_flags_are_refused_before_anything_starts(flags, says):
    result = subprocess.run([sys.executable, "-m", "stagemesh.cli", "serve", "--port", str(free_port_base(1)),
                             *flags], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "Started a local Ray" not in result.stderr
