"""The per-stage profile's arithmetic over real /metrics text."""

from stagemesh.bench.profile import format_profile, parse_stage_counters, stage_profiles
from stagemesh_core.snapshots import StageStats

METRICS = """# HELP stagemesh_stage_compute_seconds_total Seconds computing
# TYPE stagemesh_stage_compute_seconds_total counter
stagemesh_stage_compute_seconds_total{host="127.0.0.1",rank="0",replica="0",worker="0"} 12.5
stagemesh_stage_compute_seconds_total{host="127.0.0.1",rank="1",replica="0",worker="0"} 15.0
# TYPE stagemesh_stage_wait_seconds_total counter
stagemesh_stage_wait_seconds_total{host="127.0.0.1",rank="0",replica="0",worker="0"} 3.0
stagemesh_stage_wait_seconds_total{host="127.0.0.1",rank="1",replica="0",worker="0"} 4.5
# TYPE stagemesh_stage_send_seconds_total counter
stagemesh_stage_send_seconds_total{host="127.0.0.1",rank="0",replica="0",worker="0"} 0.5
stagemesh_stage_send_seconds_total{host="127.0.0.1",rank="1",replica="0",worker="0"} 0.5
# TYPE stagemesh_stage_batches_total counter
stagemesh_stage_batches_total{host="127.0.0.1",rank="0",replica="0",worker="0"} 100
stagemesh_stage_batches_total{host="127.0.0.1",rank="1",replica="0",worker="0"} 100
# TYPE stagemesh_stage_tokens_total counter
stagemesh_stage_tokens_total{host="127.0.0.1",rank="0",replica="0",worker="0"} 900
stagemesh_stage_tokens_total{host="127.0.0.1",rank="1",replica="0",worker="0"} 900
# TYPE stagemesh_stage_healthy gauge
stagemesh_stage_healthy{host="127.0.0.1",rank="0",replica="0",worker="0"} 1
"""


def test_counters_are_read_per_replica_and_rank():
    counters = parse_stage_counters(METRICS)
    assert set(counters) == {(0, 0), (0, 1)}
    assert counters[(0, 1)] == StageStats(compute_seconds=15.0, wait_seconds=4.5, send_seconds=0.5,
                                                  batches=100, tokens=900)


def test_profile_is_the_difference_over_the_span_and_other_is_what_is_left():
    before = {(0, 0): StageStats(compute_seconds=2.5, wait_seconds=1.0, send_seconds=0.5, batches=20,
                                          tokens=100)}
    rows = stage_profiles(before, parse_stage_counters(METRICS), wall_s=20.0)
    entry, last = rows
    assert (entry.compute_s, entry.wait_s, entry.send_s, entry.batches, entry.tokens) == (10.0, 2.0, 0.0, 80, 800)
    assert entry.other_s == 8.0 and entry.rows_per_batch == 10.0
    assert last.compute_s == 15.0 and last.other_s == 0.0  # a stage first seen after the span counts from zero
    assert last.wait_s == 4.5
    # idle time before the span, counted when the first message arrived, is not the span's wait
    (late,) = stage_profiles({}, {(0, 1): StageStats(compute_seconds=8.0, wait_seconds=30.0, send_seconds=0.5,
                                                                 batches=10, tokens=10)}, wall_s=10.0)
    assert late.wait_s == 1.5 and late.other_s == 0.0
    table = "\n".join(format_profile("pp2", rows, gateway_cpu_s=5.0))
    assert "r0/s0" in table and "50%" in table and "25% of one core" in table
