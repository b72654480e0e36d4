"""deploy/render.py: every service rendered from one table, as valid launchd plists and as foreground runs."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import DEPLOY, RENDER

VENV = "/Users/ann/stagemesh/.venv"
HOME = "/Users/ann"
TOKEN = "/Users/ann/.ray/auth_token"


def settings(render, role, **kw):
    base = dict(role=role, ip="10.0.0.1" if role != "worker" else "10.0.0.2", venv=VENV, home=HOME,
                auth_token_path=TOKEN)
    if role == "worker":
        base["head"] = "10.0.0.1"
    base.update(kw)
    return render.validate(render.Settings(**base))


def job(render, role, **kw) -> dict:
    data = settings(render, role, **kw).plist_bytes()
    return plistlib.loads(data)


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("role", ["head", "worker", "serve"])
def test_every_role_renders_a_sound_launchd_job(render, role):
    s = settings(render, role)
    data = s.plist_bytes()
    assert data.startswith(b"<?xml") and b"<!DOCTYPE plist" in data
    plist = plistlib.loads(data)
    assert render.check_plist(data) == []
    assert plist["Label"] == f"com.stagemesh.{ {'head': 'ray-head', 'worker': 'ray-worker', 'serve': 'serve'}[role] }"
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    assert plist["ProcessType"] == "Interactive"
    log = f"{HOME}/Library/Logs/stagemesh/{plist['Label']}.log"
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == log
    assert plist["ProgramArguments"][0].startswith(f"{VENV}/bin/")
    env = plist["EnvironmentVariables"]
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert env["STAGEMESH_HOST_IP"] == s.ip
    assert env["STAGEMESH_RING_BASE_PORT"] == "32323" and env["STAGEMESH_GRPC_BASE_PORT"] == "50051"
    assert env["PATH"].split(":")[0] == f"{VENV}/bin"
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == TOKEN


def test_head_is_pinned_with_one_mlx_unit_and_blocks(render):
    plist = job(render, "head")
    argv = plist["ProgramArguments"]
    assert argv[:4] == [f"{VENV}/bin/ray", "start", "--head", "--block"]
    assert flag_value(argv, "--node-ip-address") == "10.0.0.1"
    assert json.loads(flag_value(argv, "--resources")) == {"mlx": 1}
    assert flag_value(argv, "--port") == "6379"
    # The head does not join anything, so it needs no version-match relaxation.
    assert "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL" not in plist["EnvironmentVariables"]


def test_worker_joins_the_head_and_relaxes_the_python_match(render):
    plist = job(render, "worker", head="10.0.0.1:7000", mlx_units=2, temp_dir="/tmp/r", num_cpus=4)
    argv = plist["ProgramArguments"]
    assert flag_value(argv, "--address") == "10.0.0.1:7000"
    assert flag_value(argv, "--node-ip-address") == "10.0.0.2"
    assert json.loads(flag_value(argv, "--resources")) == {"mlx": 2}
    assert flag_value(argv, "--temp-dir") == "/tmp/r" and flag_value(argv, "--num-cpus") == "4"
    assert plist["EnvironmentVariables"]["RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"] == "minor"


def test_serve_joins_the_cluster_on_the_thunderbolt_address(render):
    plist = job(render, "serve", serve_args=("-pp", "2", "--max-num-seqs", "8"), ring_base_port=33000)
    argv, env = plist["ProgramArguments"], plist["EnvironmentVariables"]
    assert argv[:2] == [f"{VENV}/bin/stagemesh", "serve"]
    assert flag_value(argv, "--host") == "10.0.0.1" and flag_value(argv, "--port") == "8000"
    assert flag_value(argv, "--ring-base-port") == "33000" == env["STAGEMESH_RING_BASE_PORT"]
    assert argv[-4:] == ["-pp", "2", "--max-num-seqs", "8"]
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert env["RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"] == "minor"


def test_serve_flags_given_after_the_double_dash_win(render):
    argv = job(render, "serve", serve_args=("--host", "0.0.0.0", "--port=9000"))["ProgramArguments"]
    assert argv.count("--host") == 1 and flag_value(argv, "--host") == "0.0.0.0"
    assert "--port" not in argv and "--port=9000" in argv


def test_no_auth_is_explicit(render):
    env = job(render, "worker", auth_token_path=None)["EnvironmentVariables"]
    assert env["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN_PATH" not in env


@pytest.mark.parametrize("change, message", [
    (dict(ip="127.0.0.1"), "peers can reach"),
    (dict(ip="mac-a.local"), "not an IP address"),
    (dict(venv=".venv"), "absolute path"),
    (dict(role="worker", head=None), "--head"),
    (dict(head="mac-a"), "HEAD_IP"),
    (dict(ring_base_port=80), "--ring-base-port 80"),
    (dict(mlx_units=0), "--mlx-units"),
    (dict(serve_args=("-pp", "2")), "only --role serve"),
    (dict(log_dir="logs"), "--log-dir"),
    (dict(role="gateway"), "--role"),
])
def test_settings_that_cannot_work_are_refused(render, change, message):
    base = dict(role="head", ip="10.0.0.1", venv=VENV, home=HOME, head=None)
    base.update(change)
    with pytest.raises(render.RenderError, match=message):
        render.validate(render.Settings(**base))


def _edited(render, role, edit) -> bytes:
    plist = job(render, role)
    edit(plist)
    return plistlib.dumps(plist)


@pytest.mark.parametrize("role, edit, message", [
    ("head", lambda p: p["ProgramArguments"].remove("--block"), "--block"),
    ("head", lambda p: p["EnvironmentVariables"].pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
     "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1"),
    ("worker", lambda p: p["ProgramArguments"].__setitem__(
        p["ProgramArguments"].index("--resources") + 1, '{"CPU": 1}'), "mlx"),
    ("worker", lambda p: p["EnvironmentVariables"].__setitem__("STAGEMESH_HOST_IP", "10.0.0.9"), "differs"),
    ("worker", lambda p: p["EnvironmentVariables"].pop("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"), "minor"),
    ("serve", lambda p: p["EnvironmentVariables"].pop("RAY_ADDRESS"), "RAY_ADDRESS"),
    ("serve", lambda p: p["ProgramArguments"].__setitem__(0, "stagemesh"), "absolute"),
    ("serve", lambda p: p.__setitem__("KeepAlive", False), "KeepAlive"),
    ("head", lambda p: p.__setitem__("StandardOutPath", "ray.log"), "StandardOutPath"),
])
def test_check_finds_what_would_break_the_job(render, role, edit, message):
    problems = render.check_plist(_edited(render, role, edit))
    assert any(message in p for p in problems), problems


def test_check_refuses_what_is_not_a_plist(render):
    assert "not a valid plist" in render.check_plist(b"<plist><dict><key>Label</dict>")[0]
    assert "top level" in render.check_plist(plistlib.dumps(["x"]))[0]


def test_the_example_sets_in_deploy_launchd_are_what_render_writes(render, tmp_path):
    written = render.write_examples(str(tmp_path))
    names = sorted(str(p.relative_to(tmp_path)) for p in written)
    assert names == ["mac-a-tp/com.stagemesh.serve.plist", "mac-a/com.stagemesh.ray-head.plist",
                     "mac-a/com.stagemesh.serve.plist", "mac-b/com.stagemesh.ray-worker.plist"]
    for rel in names:
        committed = DEPLOY / "launchd" / rel
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{committed} is stale: regenerate with `python deploy/render.py --examples deploy/launchd`")
    worker = plistlib.loads((DEPLOY / "launchd" / "mac-b" / "com.stagemesh.ray-worker.plist").read_bytes())
    assert flag_value(worker["ProgramArguments"], "--address") == "10.0.0.1:6379"
    tp = plistlib.loads((DEPLOY / "launchd" / "mac-a-tp" / "com.stagemesh.serve.plist").read_bytes())
    assert flag_value(tp["ProgramArguments"], "-tp") == "2"  # both Macs one stage


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RENDER), *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.e2e
def test_cli_writes_checks_and_prints(tmp_path):
    out = _cli("--role", "serve", "--ip", "10.0.0.1", "--venv", VENV, "--home", HOME, "--out", str(tmp_path), "--",
               "-dp", "2")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path == tmp_path / "com.stagemesh.serve.plist"
    assert plistlib.loads(path.read_bytes())["ProgramArguments"][-2:] == ["-dp", "2"]
    checked = _cli("--check", str(path), *map(str, (DEPLOY / "launchd").glob("*/*.plist")))
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 5, checked.stdout + checked.stderr
    broken = tmp_path / "broken.plist"
    broken.write_text("not a plist")
    failed = _cli("--check", str(broken))
    assert failed.returncode == 1 and "not a valid plist" in failed.stderr
    label = _cli("--role", "worker", "--ip", "10.0.0.2", "--head", "10.0.0.1", "--venv", VENV, "--print", "label")
    assert label.stdout.strip() == "com.stagemesh.ray-worker"
    command = _cli("--role", "head", "--ip", "10.0.0.1", "--venv", VENV, "--home", HOME, "--print", "command")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" in command.stdout
    assert f"{VENV}/bin/ray start --head --block --node-ip-address 10.0.0.1" in command.stdout
    bad = _cli("--role", "head", "--ip", "127.0.0.1", "--venv", VENV)
    assert bad.returncode == 2 and "render.py: error: --ip 127.0.0.1" in bad.stderr


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil exists only on macOS")
def test_plutil_accepts_the_examples():
    for path in (DEPLOY / "launchd").glob("*/*.plist"):
        assert subprocess.run(["plutil", "-lint", str(path)]).returncode == 0


def test_write_token_creates_a_private_token_once(render, tmp_path):
    path = tmp_path / "ray" / "auth_token"
    assert render.write_token(str(path)) is True
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert render.write_token(str(path)) is False and path.read_text() == token


@pytest.mark.e2e
def test_exec_becomes_the_service_with_its_environment_and_log(tmp_path):
    """--exec (how mesh.sh runs services on Linux): same argv and env as the plist, pid recorded, own session."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    record = tmp_path / "record.json"
    fake_ray = venv / "bin" / "ray"
    fake_ray.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv, 'env': dict(os.environ), 'pid': os.getpid(), 'sid': os.getsid(0), "
        f"'cwd': os.getcwd()}}, open({str(record)!r}, 'w'))\n"
        "print('Ray runtime started.')\n"
    )
    fake_ray.chmod(0o755)
    pidfile = tmp_path / "head.pid"
    env = {**os.environ, "RAY_ADDRESS": "10.9.9.9:6379", "STAGEMESH_HOST_IP": "10.9.9.9", "KEEP_ME": "1"}
    done = _cli("--role", "head", "--ip", "10.0.0.1", "--venv", str(venv), "--home", str(tmp_path),
                "--log-dir", str(tmp_path / "logs"), "--state-dir", str(tmp_path / "state"), "--no-auth",
                "--exec", "--pidfile", str(pidfile), env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(record.read_text())
    assert seen["argv"][1:5] == ["start", "--head", "--block", "--node-ip-address"]
    assert seen["env"]["STAGEMESH_HOST_IP"] == "10.0.0.1"  # the service's, never the caller's
    assert "RAY_ADDRESS" not in seen["env"]
    assert seen["env"]["KEEP_ME"] == "1" and seen["env"]["RAY_AUTH_MODE"] == "disabled"
    assert int(pidfile.read_text()) == seen["pid"] == seen["sid"]  # pid kept across exec; leads its session
    assert seen["cwd"] == str(tmp_path / "state")
    assert (tmp_path / "logs" / "com.stagemesh.ray-head.log").read_text().strip() == "Ray runtime started."
