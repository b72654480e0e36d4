"""stagemesh bench serve end to end: the real command against real streaming HTTP servers on 127.0.0.1.

The servers (tests/bench/fake_server.py) stream tokens at a known pace, so the
measurements can be checked against it. Bounds are loose: this checks that the
benchmark measures correctly, not how fast anything is.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from stagemesh.bench.report import ENVELOPE_KEYS
from tests.bench.fake_server import FakeServer

pytestmark = pytest.mark.e2e

OUT_TOKENS = 16
FIRST_DELAY = 0.02


def bench(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def servers():
    started = []

    def start(**kw) -> FakeServer:
        server = FakeServer(**kw)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_two_endpoints_side_by_side(servers, tmp_path):
    fast = servers(model="fast-model", token_delay=0.01, first_delay=FIRST_DELAY, api_key="secret")
    # Requests 4, 9, 14 in arrival order fail: request 0 is the warmup, so 3 of the 16 measured ones do.
    slow = servers(model="slow-model", token_delay=0.02, first_delay=FIRST_DELAY, fail_every=5)
    out, png = tmp_path / "results.json", tmp_path / "results.png"
    proc = bench("--base-url", fast.url, "--label", "fast", "--api-key", "secret",
                 "--base-url", slow.url + "/v1", "--label", "slow", "--api-key", "",
                 "--concurrency", "1,4", "--num-prompts", "8", "--input-len", "64", "--output-len", str(OUT_TOKENS),
                 "--warmup", "1", "--ignore-eos", "--output", str(out), "--plot", str(png))
    assert proc.returncode == 1, proc.stderr  # 1: some requests failed
    report = json.loads(out.read_text())
    doc = report["results"]

    assert list(report) == list(ENVELOPE_KEYS) and report["kind"] == "serve"
    assert report["command"][:3] == ["stagemesh", "bench", "serve"]
    assert set(doc) == {"endpoints", "summary", "levels", "rounds", "warmup", "requests"}
    # models came from GET /v1/models; the key reached the endpoint that needs it
    assert [(e["label"], e["model"]) for e in doc["endpoints"]] == [("fast", "fast-model"), ("slow", "slow-model")]
    assert doc["summary"] == {"sent": 32, "completed": 29, "failed": 3, "warmup_failed": 0}
    assert len(doc["requests"]) == 32 and len(fast.bodies) == len(slow.bodies) == 17
    assert all(b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in fast.bodies)
    # the same prompts went to both endpoints (in the same order, up to concurrent arrivals)
    assert sorted(b["prompt"] for b in fast.bodies) == sorted(b["prompt"] for b in slow.bodies)
    assert len({b["prompt"] for b in fast.bodies}) == 17

    levels = {(m["endpoint"], m["level"]): m for m in doc["levels"]}
    assert list(levels) == [("fast", "concurrency=1"), ("slow", "concurrency=1"),
                            ("fast", "concurrency=4"), ("slow", "concurrency=4")]
    assert sum(m["failed"] for m in doc["levels"] if m["endpoint"] == "fast") == 0
    assert sum(m["failed"] for m in doc["levels"] if m["endpoint"] == "slow") == 3
    for m in doc["levels"]:
        assert m["completed"] + m["failed"] == m["sent"] == 8
        for e in m["errors"]:
            assert (e["status"], e["message"]) == (503, "overloaded (test)")
    for r in doc["requests"]:
        if r["ok"]:
            assert (r["output_tokens"], r["output_tokens_source"]) == (OUT_TOKENS, "usage")
            assert len(r["chunk_times"]) == OUT_TOKENS and r["prompt_tokens_source"] == "usage"
        else:
            assert r["status"] == 503 and r["endpoint"] == "slow"

    # ITL is the server's per-token delay; TTFT its first-token delay (plus a request's overhead)
    for (endpoint, _), m in levels.items():
        delay = 0.01 if endpoint == "fast" else 0.02
        assert 0.5 * delay < m["itl"]["p50"] < 2.5 * delay, (endpoint, m["itl"])
        assert 0.8 * delay < m["itl"]["mean"] < 2.5 * delay, (endpoint, m["itl"])
        assert 0.8 * delay < m["tpot"]["p50"] < 2.5 * delay, (endpoint, m["tpot"])
        assert FIRST_DELAY * 0.8 < m["ttft"]["p50"] < FIRST_DELAY + 0.25, (endpoint, m["ttft"])
        assert m["output_tokens_per_s"] == pytest.approx(m["output_tokens"] / m["wall_time"])

    # side by side: at concurrency 1 (one request at a time, so failures do not bunch up) the throughput
    # ratio is the ratio of per-request times
    ratio = {r["level"]: r for r in report["ratios"]}
    expected = (FIRST_DELAY + (OUT_TOKENS - 1) * 0.01) / (FIRST_DELAY + (OUT_TOKENS - 1) * 0.02)
    assert 0.6 * expected < ratio["concurrency=1"]["output_tokens_per_s"] < 1.4 * expected, ratio
    for r in report["ratios"]:
        assert r["baseline"] == "fast" and r["endpoint"] == "slow"
        assert 1.3 < r["itl_p50"] < 3.5, r
        assert r["output_tokens_per_s"] == pytest.approx(
            levels[("slow", r["level"])]["output_tokens_per_s"] / levels[("fast", r["level"])]["output_tokens_per_s"])
    # fast's throughput grows with concurrency (the server overlaps requests)
    assert levels[("fast", "concurrency=4")]["output_tokens_per_s"] > 1.5 * levels[("fast", "concurrency=1")][
        "output_tokens_per_s"]

    table = proc.stdout
    assert "TTFT p50" in table and "FAILED: 3 of 32 requests" in table
    assert "HTTP 503: overloaded (test)" in table and "ratios to fast" in table
    assert "slow concurrency=4" in proc.stderr  # progress
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def test_chat_open_loop_rounds_and_no_usage_from_the_server(servers, tmp_path):
    server = servers(model="m", token_delay=0.005, first_delay=0.01, send_usage=False)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = bench("--base-url", server.url, "--endpoint-type", "chat", "--request-rate", "40,inf",
                 "--num-prompts", "6", "--rounds", "2", "--output-len", "8", "--warmup", "0", "--output", str(out),
                 "--plot", str(png), "--json")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())  # strict JSON: an infinite rate is the string "inf"
    assert json.loads(proc.stdout) == report  # --json: the report itself on stdout, instead of the table
    doc = report["results"]
    assert doc["summary"] == {"sent": 24, "completed": 24, "failed": 0, "warmup_failed": 0}
    assert all("messages" in b and "ignore_eos" not in b for b in server.bodies)
    assert [(m["level"], m["load"], m["load_value"], m["rounds"], m["completed"]) for m in doc["levels"]] == [
        ("rate=40", "rate", 40.0, 2, 12), ("rate=inf", "rate", "inf", 2, 12)]
    assert [r["round"] for r in doc["rounds"]] == [1, 1, 2, 2] and report["ratios"] == []
    # no usage in the stream: tokens are counted from the chunks
    assert {(r["output_tokens"], r["output_tokens_source"]) for r in doc["requests"]} == {(8, "chunks")}
    assert {r["prompt_tokens_source"] for r in doc["requests"]} == {"words"}
    # Poisson arrivals at 40/s spread the sends; "inf" sends all at once. Compared on the times each
    # send was due (start minus its lateness), which a slow machine cannot move.
    due = {lv: [r["start"] - r["queued"] for r in doc["requests"] if r["level"] == lv and r["round"] == 1]
           for lv in ("rate=40", "rate=inf")}
    assert max(due["rate=40"]) - min(due["rate=40"]) > 0.02
    assert max(due["rate=inf"]) - min(due["rate=inf"]) == pytest.approx(0.0, abs=1e-3)
    # every request has its own prompt, across levels and rounds too (no prefix-cache hits)
    assert len({b["messages"][0]["content"] for b in server.bodies}) == 24
    assert png.read_bytes().startswith(b"\x89PNG")


def test_unreachable_endpoint_is_a_clear_setup_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the bench runs: nothing listens there
    proc = bench("--base-url", f"http://127.0.0.1:{port}", "--warmup", "0", timeout=30)
    assert proc.returncode == 2
    assert "cannot reach" in proc.stderr and "--base-url" in proc.stderr
