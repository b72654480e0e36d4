"""Two "hosts" on one Linux machine: two network namespaces joined by a veth pair.

Like two Macs on a Thunderbolt cable: host A is 10.0.0.1/24, host B 10.0.0.2/24,
and each namespace has only its loopback and its end of the cable, so nothing
run inside can reach (or be reached from) any other network. Every process of
a test runs through ``TwoHosts.run`` (``ip netns exec``); ``teardown`` kills
whatever is still inside the namespaces (``ip netns pids``: exactly their
processes, nothing else on the machine) and deletes them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ADDRESS_A = "10.0.0.1"
ADDRESS_B = "10.0.0.2"
# Never inherited by what runs inside: each process gets exactly the settings the test gives it.
_SCRUBBED = ("RAY_ADDRESS", "STAGEMESH_HOST_IP", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
             "STAGEMESH_RING_BASE_PORT", "STAGEMESH_GRPC_BASE_PORT", "STAGEMESH_API_KEY",
             "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@dataclass
class TwoHosts:
    ns_a: str
    ns_b: str
    veth_a: str
    veth_b: str
    workdir: Path  # state, logs and hosts files of the test (kept with pytest's tmp_path)
    created: list[str] = field(default_factory=list)
    scratch: list[Path] = field(default_factory=list)  # short /tmp paths (Ray's --temp-dir), removed at teardown

    def temp_dir(self, host: str) -> str:
        """A short directory for Ray's --temp-dir (its socket paths must stay under 108 bytes)."""
        path = Path(f"/tmp/{self.ns(host)}")
        path.mkdir(exist_ok=True)
        self.scratch.append(path)
        return str(path)

    def ns(self, host: str) -> str:
        return {"a": self.ns_a, "b": self.ns_b}[host]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
        env.update({"RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "NO_PROXY": "*"})
        env.update(extra)
        return env

    def run(self, host: str, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
            check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``a`` or ``b`` and wait for it."""
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *argv], capture_output=True, text=True,
                              env=env or self.env(), timeout=timeout, check=check)

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.ns(host), check=False).stdout
        return [int(p) for p in out.split()]

    def teardown(self) -> list[int]:
        """Kill every process left in the namespaces, delete them; returns the pids that had to be killed."""
        leftovers = []
        for ns in self.created:
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    leftovers.append(pid)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for ns in self.created:
            while _ip("netns", "pids", ns, check=False).stdout.split() and time.monotonic() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", ns, check=False)
        self.created.clear()
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)
        return leftovers


def make_two_hosts(tag: str, workdir: Path) -> TwoHosts:
    """Create the namespaces and the cable (no addresses yet: ``mesh.sh network`` assigns them)."""
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")
    pid = os.getpid()
    hosts = TwoHosts(f"sm{tag}a{pid}", f"sm{tag}b{pid}", f"sm{tag}va{pid}"[:15], f"sm{tag}vb{pid}"[:15], workdir)
    try:
        for ns in (hosts.ns_a, hosts.ns_b):
            _ip("netns", "add", ns)
            hosts.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", hosts.veth_a, "type", "veth", "peer", "name", hosts.veth_b)
        _ip("link", "set", hosts.veth_a, "netns", hosts.ns_a)
        _ip("link", "set", hosts.veth_b, "netns", hosts.ns_b)
    except subprocess.CalledProcessError as exc:
        hosts.teardown()
        _ip("link", "del", hosts.veth_a, check=False)
        raise NamespacesUnavailable(f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}") from None
    return hosts
