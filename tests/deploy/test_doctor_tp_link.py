"""``stagemesh doctor --tp-link``: a real MLX ring group of two processes on loopback (locally, and as two actors on
two nodes of a loopback Ray cluster), its report read back by ``stagemesh plan --tp-link``; refusals exit 2 naming
what to change. The refusals run in this process (no process starts); the measurements are e2e."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stagemesh.cli import main
from stagemesh.doctor.tp_link import TpLinkConfig, check_backend, percentiles_us, probe_plan, summarize
from stagemesh_core.errors import UserError
from tests.conftest import free_port_base


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "STAGEMESH_"))}


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stagemesh.cli", "doctor", "--no-resolve", "--local", *args],
                          capture_output=True, text=True, timeout=300, env=_clean_env())


@pytest.mark.parametrize(("args", "says"), [
    (["--tp-backend", "jaccl"], "--tp-backend jaccl is not available in this host's MLX: it needs RDMA over "
                                "Thunderbolt 5"),
    (["--tp-backend", "nccl"], "--tp-backend nccl is not available in this host's MLX: it needs MLX's CUDA build"),
    (["--hidden-size", "0"], "--hidden-size must be at least 1"),
    (["--prefill-rows", "0"], "--prefill-rows must be at least 1"),
])
def test_refusals_exit_2_naming_what_to_change(capsys, args, says):
    assert main(["doctor", "--local", "--no-resolve", "--tp-link", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "use --tp-backend ring" in err or "must be at least 1" in err


def test_an_unknown_backend_is_refused_by_its_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--local", "--tp-link", "--tp-backend", "gloo"])
    assert exit_.value.code == 2
    assert "invalid choice: 'gloo' (choose from 'ring', 'jaccl', 'nccl')" in capsys.readouterr().err


def test_its_flags_without_tp_link_are_refused(capsys):
    assert main(["doctor", "--local", "--no-resolve", "--tp-backend", "ring", "--hidden-size", "64"]) == 2
    assert "--tp-backend, --hidden-size only apply with --tp-link" in capsys.readouterr().err


def test_jaccl_without_its_rdma_device_file_is_refused(monkeypatch):
    """Where MLX has jaccl (a Mac with RDMA), the device file every member needs is still checked first."""
    import mlx.core as mx

    monkeypatch.setattr(mx.distributed, "is_available", lambda backend=None: True)
    with pytest.raises(UserError, match="needs MLX_IBV_DEVICES on every node"):
        check_backend("jaccl", env={})
    check_backend("jaccl", env={"MLX_IBV_DEVICES": "/etc/mlx/devices.json"})


def test_the_probe_plan_is_a_one_stage_group_on_the_meshs_ports():
    plan = probe_plan(("10.0.0.1", "10.0.0.2"), "ring", 32323, 50051)
    assert plan.tensor_parallel_size == 2 and plan.tp_backend == "ring"
    assert plan.group_hostfile(0) == [["10.0.0.1:32325"], ["10.0.0.2:32326"]]
    assert plan.worker(0, 1).host == "10.0.0.2" and plan.worker(0, 1).lane_port == 32327


def test_summary_of_two_members():
    config = TpLinkConfig(hidden_size=1000, prefill_rows=1000)
    member = {"dtype": "float32", "itemsize": 4, "device": "cpu", "bandwidth_gbs": 5.0,
              "decode_s": [1e-4, 2e-4, 3e-4], "prefill_s": [1e-3], "hop_rtt_s": [1e-4, 1e-4]}
    report = summarize([member, {**member, "bandwidth_gbs": 4.0}], ("a", "b"), config, "local")
    assert report["allreduce_us"]["decode"]["median"] == 200.0 and report["hop_us"]["median"] == 50.0
    assert report["prefill_bandwidth_gbs"] == pytest.approx(4.0)  # 4 MB in 1 ms
    assert report["memory_bandwidth_gbs"] == [5.0, 4.0] and report["hosts"] == ["a", "b"]
    assert percentiles_us([1e-6] * 10)["p90"] == 1.0


@pytest.mark.e2e
def test_doctor_measures_a_real_ring_between_two_local_processes_and_plan_reads_it(tmp_path):
    ring, grpc = free_port_base(8), free_port_base(4)
    done = _doctor("--json", "--tp-link", "--tp-backend", "ring", "--tp-link-iterations", "50",
                   "--ring-base-port", str(ring), "--grpc-base-port", str(grpc), "--port", str(free_port_base(1)))
    assert done.returncode in (0, 1), done.stderr  # 1: another finding on a busy machine; tp-link is checked below
    report = json.loads(done.stdout)
    link = report["tp_link"]
    assert "error" not in link, link
    assert link["mode"] == "local" and link["backend"] == "ring" and link["hosts"] == ["127.0.0.1", "127.0.0.1"]
    assert link["hidden_size"] == 576 and link["dtype"] == "float32"  # the default model's row, CPU's dtype
    for kind in ("decode", "prefill"):
        assert link["allreduce_us"][kind]["median"] > 0
    assert link["allreduce_us"]["decode"]["samples"] == 50 and link["prefill_rows"] == 512
    assert link["hop_us"]["median"] > 0 and all(b > 0 for b in link["memory_bandwidth_gbs"])
    assert [f for f in report["findings"] if f["check"] == "tp-link"][0]["severity"] == "ok"

    path = tmp_path / "link.json"
    path.write_text(done.stdout)
    plan = subprocess.run([sys.executable, "-m", "stagemesh.cli", "plan", "-tp", "2", "--tp-link", str(path),
                           "--json"], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert plan.returncode == 0, plan.stderr
    tensor = json.loads(plan.stdout)["tensor_parallel"]
    (replica,) = tensor["replicas"]
    assert tensor["link"]["allreduce_us"]["source"] == "measured"
    assert replica["allreduces_per_token"] == 60
    assert replica["allreduce_us_per_token"] == pytest.approx(60 * link["allreduce_us"]["decode"]["median"])
    # One machine: both workers share its memory, so -tp saves nothing and its all-reduces make it slower.
    assert replica["weights_saved_us_per_token"] == 0 and replica["verdict"] == "pp"


@pytest.mark.e2e
def test_plan_without_a_measurement_says_the_latency_is_an_assumption():
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "plan", "-tp", "2"], capture_output=True,
                          text=True, timeout=300, env=_clean_env())
    assert done.returncode == 0, done.stderr
    assert "(assumed: " in done.stdout and "that latency is an assumption" in done.stdout
    assert "all-reduces per token: 60 (2 per layer x 30 layers)" in done.stdout


@pytest.mark.e2e
def test_doctor_measures_between_two_ray_nodes_holding_mlx():
    """Two raylets on loopback, each with an ``mlx`` unit: the members are actors pinned to the two nodes."""
    import ray

    from stagemesh.doctor.tp_link import measure_cluster
    from tests.coordinator.helpers import loopback_cluster

    cluster, _ = loopback_cluster([{}, {}])
    try:
        ring, grpc = free_port_base(8), free_port_base(4)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        link = measure_cluster(ray, alive, TpLinkConfig(iterations=30, timeout_s=120), ring, grpc)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert "error" not in link, link
    assert link["mode"] == "cluster" and link["allreduce_us"]["decode"]["median"] > 0
    assert len(link["memory_bandwidth_gbs"]) == 2 and link["hop_us"]["median"] > 0
