"""deploy/two-mac/mesh.sh: shellcheck-clean, argument errors, --dry-run on both platforms, idempotent runs.

The real two-host run is in test_two_hosts_e2e.py; here everything stays on this
machine without touching its network: dry runs, a temporary hosts file, and a
fake ``ray`` in a fake virtualenv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.deploy.conftest import MESH_SH, RENDER, VENV

pytestmark = pytest.mark.e2e


def mesh(*args: str, state: Path, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "STAGEMESH_"))}
    run_env.update(env or {})
    return subprocess.run(["bash", str(MESH_SH), "--state-dir", str(state), *args], capture_output=True, text=True,
                          timeout=timeout, env=run_env)


def test_shellcheck_is_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck / brew install shellcheck)")
    done = subprocess.run([shellcheck, "--severity=style", str(MESH_SH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_bash_parses_it():
    assert subprocess.run(["bash", "-n", str(MESH_SH)]).returncode == 0


@pytest.mark.parametrize("args, message", [
    ([], "usage: mesh.sh"),
    (["head"], "head needs --ip IP"),
    (["head", "--ip", "127.0.0.1"], "loopback"),
    (["head", "--ip", "mac-a"], "not an IPv4 address"),
    (["worker", "--ip", "10.0.0.2"], "worker needs --head"),
    (["network", "--ip", "10.0.0.1", "--peer", "10.0.0.2"], "--peer-name"),
    (["network", "--ip", "10.0.0.1", "--peer", "10.0.0.2", "--peer-name", "b", "--peer", "10.0.0.3"],
     "one --peer-name per --peer"),
    (["network", "--ip", "10.0.0.1", "--peer", "10.0.0.1", "--peer-name", "a"], "own --ip"),
    (["head", "--ip=10.0.0.1"], "a space, not '='"),
    (["head", "--bogus"], "unknown option --bogus"),
    (["launch"], "unknown command launch"),
    (["network", "--ip", "10.0.0.1", "--peer", "10.0.0.2", "--peer-name", "b", "--netmask", "255.1.0.0"],
     "--netmask"),
])
def test_argument_errors_exit_2_and_say_what_is_missing(tmp_path, args, message):
    done = mesh("--dry-run", "--venv", VENV, *args, state=tmp_path / "state")
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert not (tmp_path / "state").exists()


def test_help():
    done = subprocess.run(["bash", str(MESH_SH), "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    for command in ("network", "head", "worker", "serve", "status", "down", "--dry-run"):
        assert command in done.stdout


def _commands(stdout: str) -> list[str]:
    return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


def test_dry_run_on_linux_prints_the_commands_and_changes_nothing(tmp_path):
    state, token = tmp_path / "state", tmp_path / "token"
    head = mesh("--dry-run", "--venv", VENV, "--auth-token-path", str(token), "head", "--ip", "10.0.0.1",
                "--temp-dir", "/tmp/r", state=state)
    assert head.returncode == 0, head.stderr
    commands = _commands(head.stdout)
    assert any(c.endswith(f"--write-token {token}") for c in commands)
    start = next(c for c in commands if "--exec" in c)
    assert f"{RENDER} --role head --ip 10.0.0.1 --venv {VENV}" in start
    assert f"--pidfile {state}/head.pid" in start
    runs = next(line for line in head.stdout.splitlines() if line.startswith("#   which runs:"))
    assert "STAGEMESH_HOST_IP=10.0.0.1" in runs and "RAY_AUTH_MODE=token" in runs
    assert f"{VENV}/bin/ray start --head --block --node-ip-address 10.0.0.1" in runs
    assert "--temp-dir /tmp/r" in runs
    serve = mesh("--dry-run", "--venv", VENV, "serve", "--ip", "10.0.0.1", "--port", "8100", "--", "-pp", "2",
                 state=state)
    assert serve.returncode == 0, serve.stderr
    runs = next(line for line in serve.stdout.splitlines() if line.startswith("#   which runs:"))
    assert "RAY_ADDRESS=10.0.0.1:6379" in runs
    assert re.search(r"stagemesh serve --host 10\.0\.0\.1 --port 8100 .* -pp 2 >>", runs)
    assert not state.exists() and not token.exists()


def test_dry_run_on_macos_bootstraps_launch_agents(tmp_path):
    state = tmp_path / "state"
    home = tmp_path / "home"
    env = {"HOME": str(home)}
    uid = os.getuid()
    head = mesh("--dry-run", "--platform", "macos", "--venv", VENV, "head", "--ip", "10.0.0.1", state=state, env=env)
    assert head.returncode == 0, head.stderr
    commands = _commands(head.stdout)
    agents = f"{home}/Library/LaunchAgents"
    assert f"launchctl bootout gui/{uid}/com.stagemesh.ray-head" in commands
    assert any(c.startswith(f"{VENV}/bin/python {RENDER} --role head --ip 10.0.0.1") and c.endswith(f"--out {agents}")
               for c in commands)
    assert f"launchctl bootstrap gui/{uid} {agents}/com.stagemesh.ray-head.plist" in commands
    assert any(f"--log-dir {home}/Library/Logs/stagemesh" in c for c in commands)
    serve = mesh("--dry-run", "--platform", "macos", "--venv", VENV, "serve", "--ip", "10.0.0.1", "--", "-dp", "2",
                 state=state, env=env)
    render_line = next(c for c in _commands(serve.stdout) if "--role serve" in c)
    assert render_line.index("--out") < render_line.index(" -- -dp 2")  # serve flags stay last
    down = mesh("--dry-run", "--platform", "macos", "--venv", VENV, "down", "--restore-dhcp", state=state, env=env)
    commands = _commands(down.stdout)
    for label in ("serve", "ray-worker", "ray-head"):
        assert f"launchctl bootout gui/{uid}/com.stagemesh.{label}" in commands
        assert f"rm -f {agents}/com.stagemesh.{label}.plist" in commands
    assert "networksetup -setdhcp Thunderbolt\\ Bridge" in commands
    assert not state.exists() and not home.exists()


def test_dry_run_network_on_macos(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    done = mesh("--dry-run", "--platform", "macos", "--venv", VENV, "network", "--ip", "10.0.0.1", "--peer",
                "10.0.0.2", "--peer-name", "mac-b", "--name", "mac-a", "--hosts-file", str(hosts),
                state=tmp_path / "state")
    assert done.returncode == 0, done.stderr
    commands = _commands(done.stdout)
    sudo = "" if os.getuid() == 0 else "sudo "
    assert f"{sudo}networksetup -setmanual Thunderbolt\\ Bridge 10.0.0.1 255.255.255.0" in commands
    assert any("socketfilterfw --unblockapp" in c and "raylet" in c for c in commands)
    assert "#   10.0.0.1 mac-a mac-a.local" in done.stdout and "#   10.0.0.2 mac-b mac-b.local" in done.stdout
    assert f"{sudo}dscacheutil -flushcache" in commands
    assert hosts.read_text() == "127.0.0.1 localhost\n"


def test_network_writes_the_hosts_block_once_and_down_removes_it(tmp_path):
    hosts = tmp_path / "hosts"
    original = "127.0.0.1 localhost\n127.0.0.1 mac-a\n10.1.1.1 printer\n"
    hosts.write_text(original)
    state = tmp_path / "state"
    args = ("--platform", "linux", "--venv", VENV, "network", "--ip", "10.0.0.1", "--peer", "10.0.0.2",
            "--peer-name", "mac-b", "--name", "mac-a", "--hosts-file", str(hosts), "--no-check")
    first = mesh(*args, state=state)
    assert first.returncode == 0, first.stderr
    block = ("# >>> stagemesh (mesh.sh network) >>>\n10.0.0.1 mac-a mac-a.local\n10.0.0.2 mac-b mac-b.local\n"
             "# <<< stagemesh <<<\n")
    assert hosts.read_text() == original + block
    again = mesh(*args, state=state)
    assert again.returncode == 0 and "already up to date" in again.stdout
    assert hosts.read_text() == original + block
    moved = mesh(*[a if a != "10.0.0.2" else "10.0.0.3" for a in args], state=state)
    assert moved.returncode == 0
    assert hosts.read_text() == original + block.replace("10.0.0.2", "10.0.0.3")
    three = mesh(*args, "--peer", "10.0.0.4", "--peer-name", "mac-c", state=state)  # N Macs: one line per peer
    assert three.returncode == 0, three.stderr
    assert hosts.read_text() == original + block.replace(
        "# <<<", "10.0.0.4 mac-c mac-c.local\n# <<<")
    down = mesh("--platform", "linux", "--venv", VENV, "down", "--restore-dhcp", state=state)
    assert down.returncode == 0, down.stderr
    assert hosts.read_text() == original
    assert not (state / "network.conf").exists()


def _local_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


@pytest.fixture
def fake_venv(tmp_path):
    """A virtualenv whose ``ray start`` prints Ray's startup line and sleeps until SIGTERM.

    It binds and contacts nothing (no ``stagemesh`` either), so ``status`` sends no traffic anywhere.
    """
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    ray = venv / "bin" / "ray"
    ray.write_text(f"#!{sys.executable}\n"
                   "import signal, sys, time\n"
                   "if sys.argv[1:2] != ['start']: sys.exit('fake ray: only start')\n"
                   "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                   "print('Ray runtime started.', flush=True)\n"
                   "time.sleep(600)\n")
    ray.chmod(0o755)
    return venv


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_linux_head_is_started_once_recorded_and_stopped_by_pid(tmp_path, fake_venv):
    address = _local_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine for --ip")
    state = tmp_path / "state"
    common = ("--venv", str(fake_venv), "--no-auth")
    started: list[int] = []
    try:
        first = mesh(*common, "head", "--ip", address, state=state)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "Ray started" in first.stdout
        pid = int((state / "head.pid").read_text())
        started.append(pid)
        assert "ray start --head --block" in " ".join(psutil.Process(pid).cmdline())
        assert os.getsid(pid) == pid  # leads its own session: down sweeps it whole
        again = mesh(*common, "head", "--ip", address, state=state)
        assert again.returncode == 0 and f"already running (pid {pid})" in again.stdout
        changed = mesh(*common, "head", "--ip", address, "--mlx-units", "2", state=state)
        assert changed.returncode == 0, changed.stderr
        assert "settings changed" in changed.stdout
        new_pid = int((state / "head.pid").read_text())
        started.append(new_pid)
        assert new_pid != pid and _gone(pid)
        assert "--resources {\"mlx\": 2}" in " ".join(psutil.Process(new_pid).cmdline())
        status = mesh(*common, "status", state=state)
        assert f"head   running, pid {new_pid}" in status.stdout
        down = mesh(*common, "down", state=state)
        assert down.returncode == 0, down.stderr
        assert f"kill -TERM {new_pid}" in down.stdout
        assert _gone(new_pid)
        assert not (state / "head.pid").exists() and not (state / "head.conf").exists()
        assert "Ray runtime started." in (state / "logs" / "com.stagemesh.ray-head.log").read_text()
        assert mesh(*common, "down", state=state).returncode == 0  # nothing left to stop: still fine
    finally:
        for pid in started:
            try:
                process = psutil.Process(pid)
                if str(fake_venv) in " ".join(process.cmdline()):
                    process.kill()
            except psutil.Error:
                pass


def test_worker_refuses_to_start_without_the_heads_token(tmp_path, fake_venv):
    address = _local_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine for --ip")
    done = mesh("--venv", str(fake_venv), "--auth-token-path", str(tmp_path / "missing"), "worker", "--ip", address,
                "--head", "10.0.0.1", state=tmp_path / "state")
    assert done.returncode == 1
    assert "no Ray auth token" in done.stderr and "scp" in done.stderr


def test_a_service_needs_its_address_on_this_node(tmp_path, fake_venv):
    done = mesh("--venv", str(fake_venv), "--no-auth", "head", "--ip", "10.255.0.77", state=tmp_path / "state")
    assert done.returncode == 1
    assert "10.255.0.77 is not on any interface" in done.stderr and "mesh.sh network" in done.stderr
