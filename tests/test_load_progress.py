"""A stage's weight-reading progress: counted, logged at intervals, carried by the stats, shown by status."""

from __future__ import annotations

import logging

from stage_worker.checkpoint import load_progress
from stage_worker.checkpoint.load_progress import LoadCounts, WeightProgress, progress_text, reporting
from stage_worker.engine.stage_status import StageStatus
from stagemesh.status import format_mesh
from stagemesh_core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats
from stagemesh_core.states import StageState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_says_percent_sizes_and_rate():
    assert progress_text(LoadCounts(3_200_000_000, 10_400_000_000), 4.0) == (
        "reading weights: 31% (3.2 of 10.4 GB, 800 MB/s)")
    assert progress_text(LoadCounts(0, 0), 0.0) == "reading weights: (0.0 of 0.0 GB)"


def test_readers_report_to_the_current_progress_only_inside_the_block(caplog):
    clock, seen = Clock(), []
    progress = WeightProgress(log=logging.getLogger("t"), interval_s=2.0, on_change=seen.append, clock=clock)
    load_progress.read(5)  # no current progress: nothing counted anywhere
    with caplog.at_level(logging.INFO, logger="t"), reporting(progress):
        load_progress.expect(1000)
        load_progress.read(100)
        clock.now += 1.0
        load_progress.read(100)  # within the interval: counted, not logged
        clock.now += 1.5
        load_progress.read(300)
        assert [c.done_bytes for c in seen] == [0, 100, 200, 500]
    load_progress.read(7)  # after the block: not counted
    assert progress.snapshot() == LoadCounts(500, 1000)
    lines = [r.getMessage() for r in caplog.records]
    # One line when the interval had passed, one closing line; the reads within the interval logged nothing.
    assert lines == [progress_text(LoadCounts(500, 1000), 2.5)] * 2


def test_status_carries_the_counts_and_the_table_shows_them():
    status = StageStatus()
    status.load = LoadCounts(2_500_000_000, 10_000_000_000)
    stats = status.stats()
    assert StageStats.from_proto(stats.to_proto()) == stats
    assert (stats.load_done_bytes, stats.load_total_bytes) == (2_500_000_000, 10_000_000_000)
    stage = StageSnapshot(rank=0, layers=(0, 16), host="h", grpc_port=1, ring_port=2, pid=7, node_id="n",
                          compute_dtype="bfloat16", quantized=False, healthy=False, state=StageState.LOADING,
                          stats=stats)
    table = format_mesh(MeshSnapshot("m", (ReplicaSnapshot(0, (stage,)),)).to_json())
    assert "loading 25% of 10.0 GB" in table
    serving = format_mesh(MeshSnapshot("m", (ReplicaSnapshot(0, (
        StageSnapshot(**{**stage.__dict__, "state": StageState.SERVING}),)),)).to_json())
    assert "loading" not in serving and "serving" in serving


def test_both_readers_count_exactly_the_bytes_of_the_slice_they_read(tmp_path):
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.stage_weights import load_stage_weights
    from tests.architectures import tiny_checkpoint
    from tests.test_gguf_format import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, n_layers=3)
    for path in (str(gguf), tiny_checkpoint("qwen3", tmp_path)):
        spec = read_model_spec(path)
        with reporting(WeightProgress()) as progress:
            load_stage_weights(spec, range(1, 2), with_embedding=False, with_head=False)
        counts = progress.snapshot()
        # Only layer 1's tensors: a middle stage of three reads a third of the layers and no embedding.
        assert 0 < counts.done_bytes == counts.total_bytes, (path, counts)
        with reporting(WeightProgress()) as whole:
            load_stage_weights(spec, range(0, spec.num_layers), with_embedding=True, with_head=True)
        assert whole.snapshot().done_bytes > counts.done_bytes * spec.num_layers >= counts.done_bytes
