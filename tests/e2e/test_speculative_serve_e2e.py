"""``stagemesh serve --speculative-config`` at PP=2 through the OpenAI SDK: greedy text equal to the package's
plain PP=1 serve, also with logprobs and a penalty (each token's logprobs equal within float rounding) and with
a response_format json_schema, each verified; speculation's counters in /metrics and ``stagemesh status``, a
draft model that is not there refused at start, and the last stage killed while requests verify: none hangs,
the replica heals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from stagemesh.status import format_mesh
from tests.e2e.serve_process import assert_stops_clean, start_serve
from tests.worker_groups import SHARED_SERVES_GROUP

# Every test here but two uses the package's shared PP=1 serve, so the module runs in that serve's group (one
# worker): the last test stops the speculating serve the others healed, so it must run on the same one.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group(SHARED_SERVES_GROUP)]

MODEL = "SmolLM2-135M-Instruct"
CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = [
    [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}],
    [{"role": "user", "content": "List the days of the week."}],
]


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    serve = start_serve(tmp_path_factory.mktemp("speculative-pp2"), "--speculative-config", json.dumps(CONFIG), pp=2)
    yield serve
    serve.stop()


def _greedy(url: str, messages) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    return reply.choices[0].message.content or ""


def test_greedy_text_is_the_same_with_speculation_at_pp2(serve_pp1, speculating):
    expected = [_greedy(serve_pp1.url, messages) for messages in PROMPTS]
    assert [_greedy(speculating.url, messages) for messages in PROMPTS] == expected
    streamed = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="none", max_retries=0).chat.completions.create(
        model=MODEL, messages=PROMPTS[0], max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected[0]
    metrics = httpx.get(f"{speculating.url}/metrics").text
    drafted = [line for line in metrics.splitlines()
               if line.startswith("stagemesh_stage_spec_decode_num_draft_tokens_total") and 'rank="0"' in line]
    accepted = [line for line in metrics.splitlines()
                if line.startswith("stagemesh_stage_spec_decode_num_accepted_tokens_total") and 'rank="0"' in line]
    assert float(drafted[0].split()[-1]) > 0 and float(accepted[0].split()[-1]) > 0, metrics
    assert 'stagemesh_stage_spec_decode_num_accepted_tokens_per_pos_total{host="127.0.0.1",position="0"' in metrics
    # The coordinator polls the stages' counters (once a second): wait for the next poll to bring them.
    deadline = time.monotonic() + 30
    while "speculative decoding accepted" not in format_mesh(speculating.mesh()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "speculative decoding accepted" in format_mesh(speculating.mesh())


def _entry_stats(serve) -> dict:
    return serve.mesh()["replicas"][0]["stages"][0]["stats"]


def _settled_entry_stats(serve) -> dict:
    """The entry stage's counters once the coordinator's polls (once a second) bring nothing new."""
    deadline = time.monotonic() + 60
    last = _entry_stats(serve)
    while time.monotonic() < deadline:
        time.sleep(2.5)
        now = _entry_stats(serve)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the entry stage's counters kept changing: {last}")


def test_logprobs_penalties_and_a_json_schema_speculate_and_keep_their_meaning(serve_pp1, speculating):
    """A request with logprobs and a frequency penalty, and one with a response_format json_schema: the same text
    and logprobs as without speculation, and both verified (the entry stage's verifications grew)."""
    requests = [
        {"messages": PROMPTS[0], "logprobs": True, "top_logprobs": 3, "frequency_penalty": 0.1},
        {"messages": [{"role": "user", "content": 'Reply with this JSON object exactly: {"code": "def add(a, b): '
                                                  'return a + b", "name": "add", "arguments": ["a", "b"]}'}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "code", "schema": {
             "type": "object", "properties": {"code": {"type": "string"}, "name": {"type": "string"},
                                              "arguments": {"type": "array", "items": {"type": "string"}}},
             "required": ["code", "name", "arguments"]}}}},
    ]
    # The counters a poll brings with a request's finish hold all of its work: they are the next request's start.
    before = _settled_entry_stats(speculating)
    for request in requests:
        got, expected = (openai.OpenAI(base_url=f"{serve.url}/v1", api_key="none", max_retries=0).chat.completions
                         .create(model=MODEL, max_tokens=40, temperature=0, **request).choices[0]
                         for serve in (speculating, serve_pp1))
        assert got.message.content == expected.message.content
        if "response_format" in request:
            if got.finish_reason == "stop":  # else cut by max_tokens: the constrained text so far
                assert isinstance(json.loads(got.message.content or "")["code"], str)
        else:
            assert got.logprobs is not None and expected.logprobs is not None
            assert [t.token for t in got.logprobs.content] == [t.token for t in expected.logprobs.content]
            for g, e in zip(got.logprobs.content, expected.logprobs.content, strict=True):
                assert g.logprob == pytest.approx(e.logprob, abs=2e-3), (g, e)
                assert [t.token for t in g.top_logprobs] == [t.token for t in e.top_logprobs], (g, e)
        deadline = time.monotonic() + 30
        while _entry_stats(speculating)["requests_finished"] <= before["requests_finished"] and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        after = _entry_stats(speculating)
        assert after["requests_finished"] > before["requests_finished"], (before, after)
        assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"], (request, before, after)
        assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"], \
            (got.message.content, after)
        before = after


def test_a_draft_model_that_is_not_there_is_refused_at_start_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "serve", "--speculative-config",
                           json.dumps({"model": str(tmp_path / "draft"), "num_speculative_tokens": 4})],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--speculative-config" in done.stderr and "not an mlx-lm model directory" in done.stderr
    assert str(tmp_path / "draft") in done.stderr


def test_a_last_stage_killed_while_requests_verify_ends_every_request_and_the_replica_heals(serve_pp1, speculating):
    """Stage 1 (the last, which verifies) is killed with SIGKILL while four speculating streams are under way:
    each stream finishes or fails with an error the SDK raises, none hangs, and the replica is rebuilt and
    answers as before. Runs after the tests that need the serve whole: it kills one of its stages."""
    client = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": f"Repeat this code exactly, four times:\n{CODE * 2}"}]
    outcomes: dict[int, str] = {}
    flowing = threading.Semaphore(0)

    def stream(index: int) -> None:
        told = False
        try:
            chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0,
                                                    stream=True)
            for chunk in chunks:
                if not told and chunk.choices and chunk.choices[0].delta.content:
                    flowing.release()
                    told = True
            outcomes[index] = "finished"
        except openai.APIError as exc:
            outcomes[index] = f"failed: {exc}"
        finally:
            if not told:
                flowing.release()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert flowing.acquire(timeout=120), "no stream started"
    last = speculating.mesh()["replicas"][0]["stages"][1]
    os.kill(last["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a stream hung after its last stage died"
    assert len(outcomes) == 4 and all(o == "finished" or o.startswith("failed: ") for o in outcomes.values())
    assert any(o.startswith("failed: ") for o in outcomes.values()), outcomes  # the kill hit requests in flight
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        stages = speculating.mesh()["replicas"][0]["stages"]
        if all(s["healthy"] for s in stages) and stages[1]["pid"] not in (None, last["pid"]):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the replica did not heal: {speculating.mesh()}")
    assert _greedy(speculating.url, PROMPTS[0]) == _greedy(serve_pp1.url, PROMPTS[0])


def test_sigterm_to_the_process_group_stops_the_healed_serve_and_leaves_nothing(speculating):
    """What systemd's stop does (SIGTERM to the whole group), after the test above replaced a stage. Runs last: it
    ends the module's serve."""
    assert_stops_clean(speculating, "sigterm-to-group")
