"""The soak's faults, injected into one stage process of a running mesh on this machine.

- ``kill``: SIGKILL, as a crash or the OOM killer would.
- ``stop``: SIGSTOP for ``hold_s``, then SIGCONT (a frozen process: swapped
  out, stuck in a driver, a debugger attached). The coordinator usually
  replaces the replica before the SIGCONT; psutil refuses to signal a pid
  that now names another process.
- ``block``: every packet to the stage's gRPC, ring and lane ports dropped for
  ``hold_s`` (a cable pulled, a firewall gone wrong): an iptables rule per port,
  matched on the stage's address and port and tagged with this soak's pid,
  removed afterwards and at exit. Needs root and ``iptables``;
  ``block_available()`` says whether this machine can.

``MeshWatch`` polls the gateway's ``GET /mesh`` and answers when a replica is
whole again; the soak's recovery time is from injection to that moment.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import psutil

KINDS = ("kill", "stop", "block")


@dataclass(frozen=True)
class Target:
    replica: int
    rank: int
    pid: int
    host: str
    ports: tuple[int, ...]  # gRPC, ring, lane


def block_available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "needs root"
    if shutil.which("iptables") is None:
        return False, "needs iptables (apt-get install iptables)"
    return True, ""


class PortBlock:
    """DROP rules for some ports of one address; ``remove()`` is idempotent and also runs at exit."""

    def __init__(self, host: str, ports: tuple[int, ...]) -> None:
        self._rules = [["INPUT", "-p", "tcp", "-d", host, "--dport", str(port), "-m", "comment", "--comment",
                        f"stagemesh-soak-{os.getpid()}", "-j", "DROP"] for port in ports]
        self._active = False
        atexit.register(self.remove)

    def add(self) -> None:
        for rule in self._rules:
            subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True, timeout=10)
        self._active = True

    def remove(self) -> None:
        if not self._active:
            return
        self._active = False
        for rule in self._rules:
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True, timeout=10)


def inject(kind: str, target: Target, hold_s: float) -> None:
    """Apply the fault and, for stop and block, end it after ``hold_s`` (blocks that long)."""
    process = psutil.Process(target.pid)
    if kind == "kill":
        process.send_signal(signal.SIGKILL)
    elif kind == "stop":
        process.send_signal(signal.SIGSTOP)
        time.sleep(hold_s)
        try:
            process.send_signal(signal.SIGCONT)  # psutil checks the pid still names this process
        except psutil.NoSuchProcess:
            pass  # the coordinator already replaced it
    elif kind == "block":
        block = PortBlock(target.host, target.ports)
        block.add()
        try:
            time.sleep(hold_s)
        finally:
            block.remove()
    else:
        raise ValueError(f"unknown fault {kind!r}: choose from {', '.join(KINDS)}")


class MeshWatch:
    """The gateway's ``/mesh``, polled every ``interval_s`` in a thread."""

    def __init__(self, url: str, interval_s: float = 0.25, verify: object = True) -> None:
        self._client = httpx.Client(base_url=url, timeout=5, verify=verify)  # type: ignore[arg-type]
        self._interval = interval_s
        self._latest: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mesh-watch", daemon=True)

    def start(self) -> MeshWatch:
        self._poll()
        self._thread.start()
        return self

    def _poll(self) -> None:
        try:
            mesh = self._client.get("/mesh").json()
        except (httpx.HTTPError, ValueError):
            return  # the gateway is busy or gone: keep the last view; the clients see the rest
        with self._lock:
            self._latest = mesh

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    def mesh(self) -> dict:
        with self._lock:
            return self._latest

    def replica(self, index: int) -> dict:
        return next(r for r in self.mesh().get("replicas", []) if r["replica"] == index)

    def all_healthy(self) -> bool:
        replicas = self.mesh().get("replicas", [])
        return bool(replicas) and all(r["healthy"] for r in replicas)

    def wait_until_whole(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.all_healthy():
                return True
            time.sleep(0.2)
        return False

    def targets(self, total_stages: int) -> list[Target]:
        """Every stage now, with its gRPC, ring and lane ports (the lane is ring + total: ``core.ports``)."""
        out = []
        for replica in self.mesh().get("replicas", []):
            for stage in replica["stages"]:
                if stage.get("pid"):
                    ring = stage["ring_port"]
                    out.append(Target(replica["replica"], stage["rank"], stage["pid"], stage["host"],
                                      (stage["grpc_port"], ring, ring + total_stages)))
        return out

    def wait_recovered(self, replica: int, old_pids: set[int], fault_ended: float, timeout_s: float,
                       clock: Callable[[], float], settle_s: float = 3.0) -> float | None:
        """When (on ``clock``) the replica was whole again, or None after ``timeout_s``.

        Whole: healthy with every stage serving, and either new processes (the coordinator replaced the
        replica) or, after the fault ended, the old ones healthy for ``settle_s`` in a row (it survived:
        the coordinator marks a stage that misses a check unhealthy at once, so a survivor is one it
        never doubted for that long).
        """
        deadline = clock() + timeout_s
        stable_since: float | None = None
        while clock() < deadline:
            try:
                now = self.replica(replica)
            except StopIteration:
                now = {}
            stages = now.get("stages", [])
            whole = bool(now.get("healthy")) and bool(stages) and all(s.get("healthy") for s in stages)
            pids = {s.get("pid") for s in stages}
            t = clock()
            if whole and pids != old_pids:
                return t
            if whole and t >= fault_ended:
                stable_since = t if stable_since is None else stable_since
                if t - stable_since >= settle_s:
                    return stable_since
            else:
                stable_since = None
            time.sleep(0.1)
        return None
