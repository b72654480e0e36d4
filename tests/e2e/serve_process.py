"""Start ``stagemesh serve`` as a real subprocess for end-to-end tests, and stop it."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from stagemesh_core import ports
from tests.conftest import free_port_base


@dataclass
class ServeProcess:
    process: subprocess.Popen
    port: int
    grpc_base: int
    ring_base: int
    log_path: Path
    pp: int
    dp: int
    descendants: list[psutil.Process] = field(default_factory=list)
    scheme: str = "http"
    tp: int = 1  # workers per stage (-tp)
    verify: ssl.SSLContext | bool = True  # httpx's verify: trusts the CA of an HTTPS gateway

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def mesh(self) -> dict:
        return httpx.get(f"{self.url}/mesh", timeout=10, verify=self.verify).json()

    def ports(self) -> list[int]:
        total = self.pp * self.dp
        return [self.port, *range(self.grpc_base, self.grpc_base + total * self.tp),
                *range(self.ring_base, self.ring_base + ports.data_plane_ports(total, self.tp))]

    def remember_descendants(self) -> None:
        self.descendants = psutil.Process(self.process.pid).children(recursive=True)

    def stop(self, sig: int = signal.SIGTERM, whole_group: bool = False, timeout: float = 60) -> int:
        if self.process.poll() is None:
            if whole_group:
                os.killpg(self.process.pid, sig)  # what Ctrl-C in a terminal does
            else:
                os.kill(self.process.pid, sig)  # what launchd / a service manager does
        try:
            return self.process.wait(timeout)
        finally:
            self.kill_leftovers()

    def kill_leftovers(self) -> None:
        """Never leave processes behind, even when a test failed."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for child in self.descendants:
            try:
                child.kill()
            except psutil.Error:
                pass


def start_serve(tmp_path: Path, *extra: str, pp: int = 1, dp: int = 1, timeout: float = 240,
                env: dict[str, str] | None = None, https_ca: str | None = None, tp: int = 1) -> ServeProcess:
    """``stagemesh serve`` on free ports; ``https_ca``: the gateway serves HTTPS with a certificate from
    that CA (the flags are the caller's)."""
    total = pp * dp
    port = free_port_base(1)
    grpc_base = free_port_base(total * tp)
    ring_base = free_port_base(ports.data_plane_ports(total, tp))
    log_path = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh.cli", "serve", "--port", str(port), "--grpc-base-port", str(grpc_base),
             "--ring-base-port", str(ring_base), "-pp", str(pp), "-dp", str(dp), "-tp", str(tp), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    serve = ServeProcess(process, port, grpc_base, ring_base, log_path, pp, dp, tp=tp,
                         scheme="https" if https_ca else "http",
                         verify=ssl.create_default_context(cafile=https_ca) if https_ca else True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"stagemesh serve exited with {process.returncode}:\n{serve.log()[-4000:]}")
        try:
            if httpx.get(f"{serve.url}/health", timeout=2, verify=serve.verify).status_code == 200:
                serve.remember_descendants()
                return serve
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    serve.remember_descendants()
    serve.stop(signal.SIGKILL)
    raise RuntimeError(f"stagemesh serve did not become healthy in {timeout:.0f} s:\n{serve.log()[-4000:]}")


def port_is_free(port: int) -> bool:
    return ports.port_is_free("127.0.0.1", port)


# How a serve is stopped: launchd (SIGTERM to the serve); a terminal's Ctrl-C (SIGINT to the process group);
# systemd's cgroup stop (SIGTERM to the group).
STOPS = {"sigterm-to-serve": (signal.SIGTERM, False), "ctrl-c-to-group": (signal.SIGINT, True),
         "sigterm-to-group": (signal.SIGTERM, True)}


def still_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited: a zombie has (it holds no memory, port or device; it
    only waits for its parent, or for PID 1 in a container, to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_stops_clean(serve: ServeProcess, how: str) -> None:
    """Stop ``serve`` the way ``how`` names (``STOPS``): it exits cleanly and leaves no stage process, no
    process it started and no bound port behind.

    Each module whose serve is stopped only at its end runs this as its last test, one way of stopping each:
    a start is Ray, the model and the stage processes, and stopping is what every serve's last moment tests
    anyway. Its processes are read again first, so a stage that was replaced during the module counts too."""
    sig, whole_group = STOPS[how]
    stage_pids = [s["pid"] for r in serve.mesh()["replicas"] for s in r["stages"]]
    workers = serve.pp * serve.dp * serve.tp
    assert len(stage_pids) == workers and all(psutil.pid_exists(p) for p in stage_pids), stage_pids
    serve.remember_descendants()
    code = serve.stop(sig, whole_group=whole_group, timeout=90)
    assert code in (0, 130, -signal.SIGINT), serve.log()[-3000:]
    deadline = time.monotonic() + 15
    leftovers: list[int] = []
    busy: list[int] = []
    while time.monotonic() < deadline:
        leftovers = [p for p in [*stage_pids, *(d.pid for d in serve.descendants)] if still_running(p)]
        busy = [port for port in serve.ports() if not port_is_free(port)]
        if not leftovers and not busy:
            return
        time.sleep(0.5)
    raise AssertionError(f"left behind: processes {leftovers}, ports {busy}")
