"""``stagemesh status``'s table: one row per stage (with the backend and device each computes on), a line per replica
that is not serving."""

from dataclasses import replace

from stagemesh.status import format_mesh
from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats
from stagemesh_core.states import ReplicaState, StageState


def test_the_table_shows_each_stages_backend_and_device():
    stage = StageSnapshot(rank=0, layers=(0, 16), host="10.0.0.1", grpc_port=50051, ring_port=32323, pid=7,
                          node_id="n", compute_dtype="bfloat16", quantized=False, healthy=True,
                          state=StageState.SERVING, backend="cuda", device="NVIDIA H200")
    mesh = MeshSnapshot("m", (ReplicaSnapshot(0, (stage,)),)).to_json()
    assert (mesh["replicas"][0]["stages"][0]["backend"], mesh["replicas"][0]["stages"][0]["device"]) == (
        "cuda", "NVIDIA H200")
    header, row = format_mesh(mesh).splitlines()[1:3]
    assert header.split()[9:11] == ["backend", "device"]
    assert "bfloat16  no     cuda     NVIDIA H200  serving" in row
    older = {"replicas": [{"replica": 0, "healthy": True, "stages": [{"rank": 0, "layers": [0, 1]}]}]}
    assert "-" in format_mesh(older).splitlines()[2]  # a gateway that predates the fields


def test_watch_view_draws_stages_rates_and_events_from_the_live_document():
    from rich.console import Console

    from stagemesh.status_watch import render

    stage = {"rank": 1, "host": "10.0.0.[2]", "layers": [15, 30], "compute_dtype": "float32", "quantized": True,
             "state": "failed", "healthy": False, "pid": None, "uptime_s": None, "kv_use": 0.5,
             "stats": {"running_sequences": 2, "waiting_requests": 1},
             "rates": {"batches_per_s": 3.0, "compute_share": 0.5, "wait_share": 0.25, "send_share": 0.0}}
    doc = {"time": 0.0, "model": "m", "num_layers": 30,
           "replicas": [{"replica": 0, "healthy": False, "restarts": 2, "in_flight": 4, "output_tokens_per_s": 12.5,
                         "stages": [stage]}],
           "overall": {"healthy_replicas": 0, "output_tokens_per_s": 12.5, "requests_running": 4,
                       "server_errors_total": 3, "client_errors_total": 1,
                       "recent": {"client_errors": 0, "server_errors": 2},
                       "ttft_s": {"count": 2, "p50": 0.1, "p90": 0.2, "p99": 0.2}, "itl_s": {"count": 0}},
           "events": [{"time": 0.0, "kind": "stage_lost", "message": "replica 0 stage 1: killed by signal 9"}]}
    console = Console(width=200, record=True)
    console.print(render(doc))
    text = console.export_text()
    assert "replica 0  UNHEALTHY  12.5 tok/s  4 in flight  2 restart(s)  TTFT -  ITL -  0 failed" in text
    assert "10.0.0.[2]" in text and "[15, 30)" in text and "float32 q" in text  # text, not markup
    assert "50%/25%/0%" in text and "3.0" in text and "2/1" in text
    assert "TTFT p50 100 ms p90 200 ms p99 200 ms" in text and "errors 2 in the last minute (4 since start)" in text
    assert "stage_lost" in text and "killed by signal 9" in text


def test_the_table_says_when_a_replica_backs_off_and_when_it_restarts():
    stage = StageSnapshot(rank=0, layers=(0, 30), host="h", grpc_port=1, ring_port=2, pid=None, node_id="n",
                          compute_dtype="float32", quantized=False, healthy=False, state=StageState.STOPPED)
    serving = ReplicaSnapshot(0, (replace(stage, healthy=True, state=StageState.SERVING, pid=5),))
    backing_off = ReplicaSnapshot(1, (stage,), restarts=3, state=ReplicaState.BACKING_OFF, consecutive_failures=3,
                                  backoff_s=4.0, next_restart_at=1012.2)
    restarting = ReplicaSnapshot(2, (stage,), restarts=4, state=ReplicaState.RESTARTING, consecutive_failures=4)
    mesh = MeshSnapshot("m", (serving, backing_off, restarting)).to_json()
    assert {k: mesh["replicas"][1][k] for k in ("state", "consecutive_failures", "backoff_s", "next_restart_at")} == {
        "state": "backing_off", "consecutive_failures": 3, "backoff_s": 4.0, "next_restart_at": 1012.2}
    lines = format_mesh(mesh, now=1000.0).splitlines()
    assert lines[-3:] == ["replica 1: backing off, restart 4 in 12 s (3 failures in a row, 3 restarts so far)",
                          "replica 2: restarting (4 failures in a row, 4 restarts so far)",
                          "1/3 replicas healthy"]
    assert "restart 4 after a 4 s wait" in format_mesh(mesh)
    assert not any(line.startswith("replica 0:") for line in lines)


def test_watch_view_titles_a_replica_with_its_backoff():
    from rich.console import Console

    from stagemesh.status_watch import render

    replica = {"replica": 1, "healthy": False, "restarts": 3, "in_flight": 0, "output_tokens_per_s": None,
               "state": "backing_off", "consecutive_failures": 3, "backoff_s": 4.0, "next_restart_at": 1012.2,
               "stages": []}
    doc = {"time": 1000.0, "model": "m", "num_layers": 30, "replicas": [replica],
           "overall": {"healthy_replicas": 0, "output_tokens_per_s": None, "requests_running": 0,
                       "server_errors_total": 0, "client_errors_total": 0}, "events": []}
    console = Console(width=200, record=True)
    console.print(render(doc))
    assert "3 restart(s)  backing off: restart 4 in 12s  TTFT" in console.export_text()


def test_watch_flags_are_checked_before_anything_is_read(capsys):
    from stagemesh.cli import main

    assert main(["status", "--count", "2"]) == 2
    assert "--interval and --count go with --watch" in capsys.readouterr().err
    assert main(["status", "--watch", "--interval", "0"]) == 2
    assert "--interval must be positive" in capsys.readouterr().err
def test_the_table_shows_each_stages_prefix_cache():
    stats = StageStats(prefix_cache_queries=200, prefix_cache_hits=50, prefix_cache_blocks=12, prefix_cache_evictions=3)
    stage = StageSnapshot(rank=1, layers=(15, 30), host="h", grpc_port=1, ring_port=2, pid=3, node_id="n",
                          compute_dtype="float32", quantized=False, healthy=True, state=StageState.SERVING,
                          stats=stats)
    mesh = MeshSnapshot("m", (ReplicaSnapshot(0, (stage,)),)).to_json()
    assert mesh["replicas"][0]["stages"][0]["stats"]["prefix_cache_hits"] == 50
    header, row = format_mesh(mesh).splitlines()[1:3]
    assert header.split()[-3:] == ["prefix_hits", "cached_blocks", "evicted_blocks"]
    assert row.split()[-3:] == ["25%/200", "12", "3"]
    assert StageStats.from_proto(stats.to_proto()) == stats  # the counters travel in GetStageInfo


def test_the_table_says_what_speculative_decoding_achieved():
    stats = StageStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=30, spec_decode_num_accepted_tokens=15,
                       spec_decode_num_accepted_tokens_per_pos=(8, 5, 2))
    stage = StageSnapshot(rank=0, layers=(0, 30), host="h", grpc_port=1, ring_port=2, pid=3, node_id="n",
                          compute_dtype="float32", quantized=False, healthy=True, state=StageState.SERVING,
                          stats=stats)
    mesh = MeshSnapshot("m", (ReplicaSnapshot(0, (stage,)),)).to_json()
    assert ("replica 0: speculative decoding accepted 50% of 30 proposed tokens (by position: 80% 50% 20%), "
            "2.50 tokens per verification") in format_mesh(mesh).splitlines()
    quiet = MeshSnapshot("m", (ReplicaSnapshot(0, (replace(stage, stats=StageStats()),)),)).to_json()
    assert "speculative" not in format_mesh(quiet)
    assert StageStats.from_proto(stats.to_proto()) == stats  # the counters travel in GetStageInfo
