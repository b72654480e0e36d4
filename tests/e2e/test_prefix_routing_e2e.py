"""Cache-aware routing on a served ``-dp 2`` mesh (real Ray, two replicas of the real model): without any client
cache key, every later turn of a conversation goes to the replica that served its first, which shows as that
turn's history reported cached (only that replica's entry stage ever saw it), and in /metrics and the
dashboard's live data as requests routed by prefix."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.serve_process import start_serve

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_serve(tmp_path_factory.mktemp("serve-dp2"), dp=2)
    yield s
    s.stop()


def _routed(serve) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(f"{serve.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("stagemesh_gateway_routed_requests_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["replica"].strip('"'), labels["policy"].strip('"'))] = float(line.split()[-1])
    return out


def test_a_conversations_turns_stay_on_the_replica_holding_its_history(serve):
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0, timeout=300)
    # Two conversations with nothing in common, taking turns: the first turns go by load (one each).
    conversations = [[{"role": "system", "content": f"You are assistant number {n}. " + "Answer briefly. " * 20}]
                     for n in (1, 2)]
    previous = [0, 0]
    for turn in range(4):
        for i, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"Question {turn + 1}: name a fruit."})
            r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn == 0:
                assert cached == 0
            else:  # at least the previous turn's whole blocks: the replica that served it holds them
                assert cached >= previous[i] // 16 * 16 and cached >= r.usage.prompt_tokens / 2, (turn, i, r.usage)
            previous[i] = r.usage.prompt_tokens
    routed = _routed(serve)
    assert sum(v for (_, policy), v in routed.items() if policy == "prefix") == 6, routed
    assert {replica for (replica, policy), v in routed.items() if policy == "load" and v} == {"0", "1"}, routed
    live = httpx.get(f"{serve.url}/dashboard/live", timeout=10).json()
    assert sorted(r["routed"]["prefix"] for r in live["replicas"]) == [3, 3]
    assert all(0 < r["prefix_cache_hit_rate"] <= 1 for r in live["replicas"])
