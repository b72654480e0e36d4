"""``stagemesh status``'s table: one row per stage, with the backend and device each computes on."""

from stagemesh.core.snapshots import MeshSnapshot, ReplicaSnapshot, StageSnapshot, StageStats
from stagemesh.core.states import StageState
from stagemesh.status import format_mesh


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
