"""StageHost as a plain object (no Ray): process lifecycle, logs, ports, addresses."""

from __future__ import annotations

import socket
import sys
import time

import psutil
import pytest

from coordinator.stage_host import StageHost, StageHostError, advertised_host, busy_ports, stage_env

SLEEPER = ("-c", "import sys, time; print('args', sys.argv[1:], flush=True); time.sleep(60)")
STUBBORN = ("-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('up', flush=True); time.sleep(60)")

NODES = [
    {"NodeID": "aaa", "Alive": True, "NodeManagerAddress": "127.0.0.1"},
    {"NodeID": "bbb", "Alive": True, "NodeManagerAddress": "10.0.0.2"},
    {"NodeID": "ccc", "Alive": False, "NodeManagerAddress": "10.0.0.3"},
]


def test_advertised_host_prefers_the_env_then_the_ray_node_address():
    assert advertised_host("bbb", {}, NODES) == ("10.0.0.2", "ray node address")
    assert advertised_host("bbb", {"STAGEMESH_HOST_IP": " 169.254.7.1 "}, NODES) == (
        "169.254.7.1", "STAGEMESH_HOST_IP")
    with pytest.raises(StageHostError, match="set STAGEMESH_HOST_IP"):
        advertised_host("ccc", {}, NODES)


def test_stage_env_drops_rays_forced_thread_limit():
    assert "OMP_NUM_THREADS" not in stage_env({"OMP_NUM_THREADS": "1", "A": "b"})
    assert stage_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    assert stage_env({})["PYTHONUNBUFFERED"] == "1"


def test_a_host_reports_the_gpus_its_stages_may_take(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert StageHost("gpus").describe_local("bbb", NODES).gpu_count == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert StageHost("none").describe_local("bbb", NODES).gpu_count == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("coordinator.stage_host.nvidia_smi_list", lambda env: "GPU 0: A\nGPU 1: B\n")
    assert StageHost("smi").describe_local("bbb", NODES).gpu_count == 2


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.e2e
def test_start_poll_log_and_stop():
    host = StageHost("t")
    assert host.poll() is None and host.stop() is None and host.log_tail() == ""
    pid = host.start('{"plan": 1}', command=SLEEPER)
    _wait_for(lambda: "args" in host.log_tail())
    assert "'--launch'" in host.log_tail() and "launch.json" in host.log_tail()
    assert host.poll() is None and host.pid() == pid
    with pytest.raises(StageHostError, match="still running"):
        host.start("{}", command=SLEEPER)
    assert host.stop(grace_s=2) == -15
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.e2e
def test_stop_escalates_to_sigkill():
    host = StageHost("t")
    host.start("{}", command=STUBBORN)
    _wait_for(lambda: "up" in host.log_tail())
    started = time.monotonic()
    assert host.stop(grace_s=0.5) == -9
    assert time.monotonic() - started < 15  # the grace, then SIGKILL: no long wait


@pytest.mark.e2e
def test_terminate_and_wait():
    host = StageHost("t")
    host.start("{}", command=SLEEPER)
    assert host.wait(0.1) is None
    host.terminate()
    assert host.wait(5) == -15


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_stage_dies_with_its_host_process(tmp_path):
    import subprocess

    script = (
        "from coordinator.stage_host import StageHost; import sys, time\n"
        f"h = StageHost('t'); print(h.start('{{}}', command={SLEEPER!r}), flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    stage_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()

    def gone() -> bool:
        try:
            return psutil.Process(stage_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    _wait_for(gone, timeout=5)


def test_busy_ports_sees_listeners_not_time_wait():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        assert busy_ports("127.0.0.1", [port]) == [port]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the accepted side closes first: TIME_WAIT on `port`
        client.close()
    finally:
        listener.close()
    assert busy_ports("127.0.0.1", [port]) == []
