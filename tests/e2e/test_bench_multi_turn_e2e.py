"""``stagemesh bench serve --workload multi-turn`` against a real ``stagemesh serve`` of the default model (the
package's shared PP=1 serve): every turn succeeds, later turns are served from the prefix cache (the gateway's
/metrics says how many prompt tokens were reused), and the report has each turn's time to first token."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

SYSTEM_LEN, USER_LEN, TURNS, CONVERSATIONS = 48, 8, 3, 2
HITS_FLOOR = CONVERSATIONS * (TURNS - 1) * (SYSTEM_LEN // 16 * 16)  # every later turn reuses the system prompt


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "stagemesh_stage_prefix_cache_hits_total")


def test_later_turns_hit_the_prefix_cache_and_every_request_succeeds(tmp_path, default_model_path, serve_pp1):
    serve = serve_pp1
    # The serve is shared: the hits before the run are other tests'. The conversations' random prompts share
    # no whole block with anything sent before, so every hit counted from here on is this run's.
    before = prefix_cache_hits(serve.url)
    out = tmp_path / "multi-turn.json"
    # No warmup: nothing of the conversations is cached before they start, and both start together, so no
    # turn 1 can find anything cached (only finished sequences are kept): every hit is a later turn's.
    proc = subprocess.run(
        [sys.executable, "-m", "stagemesh.cli", "bench", "serve", "--base-url", serve.url, "--workload",
         "multi-turn",
         "--concurrency", str(CONVERSATIONS), "--system-len", str(SYSTEM_LEN), "--user-len", str(USER_LEN),
         "--turns", str(TURNS), "--output-len", "4", "--warmup", "0", "--tokenizer", default_model_path,
         "--output", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    # The stages' counters reach /metrics through the coordinator's snapshot, refreshed every second
    # (health_interval_s): right after the last turn it can still hold the previous reading.
    deadline = time.monotonic() + 10
    hits = prefix_cache_hits(serve.url) - before
    while hits < HITS_FLOOR and time.monotonic() < deadline:
        time.sleep(0.2)
        hits = prefix_cache_hits(serve.url) - before

    doc = json.loads(out.read_text())["results"]
    assert doc["summary"] == {"sent": CONVERSATIONS * TURNS, "completed": CONVERSATIONS * TURNS, "failed": 0,
                              "warmup_failed": 0}
    requests = doc["requests"]
    assert sorted((r["index"], r["turn"]) for r in requests) == [
        (c, t) for c in range(CONVERSATIONS) for t in range(1, TURNS + 1)]
    # every turn re-sent the history: the server counted a longer prompt each turn
    for c in range(CONVERSATIONS):
        lengths = [r["prompt_tokens"] for r in sorted(requests, key=lambda r: r["turn"]) if r["index"] == c]
        assert lengths[0] > SYSTEM_LEN + USER_LEN and lengths == sorted(set(lengths)), lengths
    # each later turn reused at least the system prompt's whole blocks (block size 16)
    assert hits >= HITS_FLOOR, hits
    (level,) = doc["levels"]
    assert [d["count"] for d in level["ttft_by_turn"]] == [CONVERSATIONS] * TURNS
    assert "TTFT p50 by turn" in proc.stdout
