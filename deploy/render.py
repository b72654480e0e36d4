#!/usr/bin/env python3
"""The one source of truth for how a stagemesh node runs its services.

Three services make a mesh of Macs, each described once as data (``SERVICES``: program arguments and
environment with ``{placeholders}``): ``head`` (Mac A: ``ray start --head --block``), ``worker`` (Mac B, C..:
``ray start --address HEAD:6379 --block``), both pinned to the Thunderbolt address, and ``serve`` (Mac A:
``stagemesh serve`` joining that cluster through ``RAY_ADDRESS``). From that description this script

- renders launchd plists (``--out DIR``; ``--print plist``), which is how ``deploy/two-mac/mesh.sh``
  installs the services on macOS;
- runs the very same command in the foreground (``--exec``: same argv, same environment on top of the
  caller's, output appended to the same log file), which is how ``mesh.sh`` drives Linux nodes and the tests;
- validates plists (``--check FILE...``) and writes the example sets in ``deploy/launchd/`` (``--examples DIR``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import plistlib
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

try:
    import stagemesh_core  # noqa: F401  (installed in the venv this script is run with)
except ModuleNotFoundError:
    # Run from a checkout with a Python that lacks the package: the core is standard library
    # only, so the checkout's own copy serves.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stagemesh_core.settings import DEFAULT_GATEWAY_PORT, DEFAULT_GRPC_BASE_PORT, DEFAULT_RING_BASE_PORT, MLX_RESOURCE

LABEL_PREFIX = "com.stagemesh"
DEFAULT_RAY_PORT = 6379

# Variables a service sets itself; the caller's values never leak into --exec.
_SCRUBBED = ("RAY_ADDRESS", "STAGEMESH_HOST_IP", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
             "STAGEMESH_RING_BASE_PORT", "STAGEMESH_GRPC_BASE_PORT", "VIRTUAL_ENV")


@dataclass(frozen=True)
class ServiceSpec:
    """One service as data: ``{placeholders}`` are filled from ``Settings.values()``."""

    role: str
    label: str  # after the prefix
    summary: str
    program: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    # flag -> setting name: appended as "flag value" when that setting is not None
    optional: tuple[tuple[str, str], ...] = ()
    throttle_s: int = 10


# What every service carries, and why (the pitfalls of multi-Mac Ray + MLX):
# - RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: Ray refuses multi-node clusters on macOS without it (and pins itself
#   to loopback).
# - RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor on whatever joins a cluster (worker, the serve driver): Ray
#   otherwise refuses a node whose Python patch version differs from the head's.
# - STAGEMESH_HOST_IP = the node's Thunderbolt address, on `ray start` (its raylet passes it to the stage hosts,
#   which advertise it for the ring and gRPC), and --node-ip-address to the same address (Ray's own traffic).
# - --resources={"mlx": N}: stagemesh places one stage per mlx unit.
# - STAGEMESH_RING_BASE_PORT / STAGEMESH_GRPC_BASE_PORT: the same on every node.
# - RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (``Settings.environment``): Ray 2.60 turns token authentication
#   on for a head that finds ~/.ray/auth_token; a worker without the same token cannot join ("Authentication
#   token is missing or incorrect"), so the mode and the token file are explicit on every node.
# - --block: launchd supervises the process it started; a `ray start` that daemonizes and exits would be
#   restarted in a loop.
# - In the plist (``Settings.plist``): KeepAlive, RunAtLoad, ProcessType=Interactive (no App Nap / background
#   QoS throttling of inference), logs under ~/Library/Logs/stagemesh, the venv's absolute paths (launchd has
#   no shell, no PATH, no activated venv).
_COMMON_ENV = (
    ("PATH", "{venv}/bin:/usr/bin:/bin:/usr/sbin:/sbin"),
    ("PYTHONUNBUFFERED", "1"),
    ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("RAY_prestart_worker_first_driver", "0"),  # the mesh runs actors only: no idle task workers
    ("STAGEMESH_HOST_IP", "{ip}"),
    ("STAGEMESH_RING_BASE_PORT", "{ring_base_port}"),
    ("STAGEMESH_GRPC_BASE_PORT", "{grpc_base_port}"),
)
_JOIN_ENV = (("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL", "{python_match_level}"),)

SERVICES: dict[str, ServiceSpec] = {
    "head": ServiceSpec(
        role="head", label="ray-head", summary="Ray head (Mac A)",
        program=("{venv}/bin/ray", "start", "--head", "--block", "--node-ip-address", "{ip}",
                 "--port", "{ray_port}", "--resources", "{resources}", "--include-dashboard=false",
                 "--disable-usage-stats"),
        environment=_COMMON_ENV,
        optional=(("--num-cpus", "num_cpus"), ("--temp-dir", "temp_dir")),
    ),
    "worker": ServiceSpec(
        role="worker", label="ray-worker", summary="Ray worker (Mac B, C, ...)",
        program=("{venv}/bin/ray", "start", "--block", "--address", "{head_address}", "--node-ip-address", "{ip}",
                 "--resources", "{resources}", "--disable-usage-stats"),
        environment=_COMMON_ENV + _JOIN_ENV,
        optional=(("--num-cpus", "num_cpus"), ("--temp-dir", "temp_dir")),
    ),
    "serve": ServiceSpec(
        role="serve", label="serve", summary="stagemesh serve: coordinator + OpenAI gateway (Mac A)",
        program=("{venv}/bin/stagemesh", "serve"),
        environment=_COMMON_ENV + _JOIN_ENV + (("RAY_ADDRESS", "{head_address}"),),
    ),
}


class RenderError(ValueError):
    """Settings that cannot make a working service; the message says which."""


@dataclass(frozen=True)
class Settings:
    role: str
    ip: str
    venv: str
    head: str | None = None  # HEAD_IP or HEAD_IP:PORT (worker: required; serve: defaults to ip)
    ray_port: int = DEFAULT_RAY_PORT
    mlx_units: int = 1
    num_cpus: int | None = None
    temp_dir: str | None = None
    ring_base_port: int = DEFAULT_RING_BASE_PORT
    grpc_base_port: int = DEFAULT_GRPC_BASE_PORT
    gateway_port: int = DEFAULT_GATEWAY_PORT
    gateway_host: str | None = None  # default: ip
    auth_token_path: str | None = None  # None: token auth off (RAY_AUTH_MODE=disabled)
    python_match_level: str = "minor"
    home: str = field(default_factory=lambda: str(Path.home()))
    log_dir: str | None = None  # default: HOME/Library/Logs/stagemesh
    state_dir: str | None = None  # working directory; default: HOME/.stagemesh
    label_prefix: str = LABEL_PREFIX
    serve_args: tuple[str, ...] = ()

    # -- derived ------------------------------------------------------------------

    @property
    def spec(self) -> ServiceSpec:
        return SERVICES[self.role]

    @property
    def label(self) -> str:
        return f"{self.label_prefix}.{self.spec.label}"

    @property
    def logs(self) -> str:
        return self.log_dir or os.path.join(self.home, "Library", "Logs", "stagemesh")

    @property
    def log_path(self) -> str:
        return os.path.join(self.logs, f"{self.label}.log")

    @property
    def working_directory(self) -> str:
        return self.state_dir or os.path.join(self.home, ".stagemesh")

    @property
    def head_address(self) -> str:
        head = self.head or (self.ip if self.role == "serve" else "")
        if not head:
            return ""
        host, _, port = head.rpartition(":") if head.count(":") == 1 else (head, "", "")
        return f"{host}:{port}" if port else f"{head}:{self.ray_port}"

    def values(self) -> dict[str, str | None]:
        return {
            "ip": self.ip, "venv": self.venv, "ray_port": str(self.ray_port),
            "resources": json.dumps({MLX_RESOURCE: self.mlx_units}),
            "head_address": self.head_address, "ring_base_port": str(self.ring_base_port),
            "grpc_base_port": str(self.grpc_base_port), "python_match_level": self.python_match_level,
            "num_cpus": None if self.num_cpus is None else str(self.num_cpus), "temp_dir": self.temp_dir,
        }

    # -- the service ----------------------------------------------------------------

    def program_arguments(self) -> list[str]:
        values = self.values()
        argv = [part.format(**values) for part in self.spec.program]
        for flag, name in self.spec.optional:
            value = values.get(name)
            if value is not None:
                argv += [flag, value]
        if self.role == "serve":
            extra = list(self.serve_args)
            if not _has_flag(extra, "--host"):
                argv += ["--host", self.gateway_host or self.ip]
            if not _has_flag(extra, "--port"):
                argv += ["--port", str(self.gateway_port)]
            if not _has_flag(extra, "--ring-base-port"):
                argv += ["--ring-base-port", str(self.ring_base_port)]
            if not _has_flag(extra, "--grpc-base-port"):
                argv += ["--grpc-base-port", str(self.grpc_base_port)]
            argv += extra
        return argv

    def environment(self) -> dict[str, str]:
        values = self.values()
        env = {name: value.format(**values) for name, value in self.spec.environment}
        if self.auth_token_path:
            env["RAY_AUTH_MODE"] = "token"
            env["RAY_AUTH_TOKEN_PATH"] = self.auth_token_path
        else:
            env["RAY_AUTH_MODE"] = "disabled"
        return env

    def plist(self) -> dict:
        """The launchd job, keys in the order a reader expects."""
        return {
            "Label": self.label,
            "ProgramArguments": self.program_arguments(),
            "EnvironmentVariables": self.environment(),
            "WorkingDirectory": self.working_directory,
            "RunAtLoad": True,
            "KeepAlive": True,
            "ThrottleInterval": self.spec.throttle_s,
            "ProcessType": "Interactive",
            "SoftResourceLimits": {"NumberOfFiles": 10240},
            "StandardOutPath": self.log_path,
            "StandardErrorPath": self.log_path,
        }

    def plist_bytes(self) -> bytes:
        return plistlib.dumps(self.plist(), sort_keys=False)

    def shell_command(self) -> str:
        """What ``--exec`` runs, as one shell line (for ``mesh.sh --dry-run`` and humans)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.environment().items())
        return f"env {env} {shlex.join(self.program_arguments())} >> {shlex.quote(self.log_path)} 2>&1"


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def validate(settings: Settings) -> Settings:
    """Refuse settings that cannot work, naming the flag; returns them unchanged."""
    if settings.role not in SERVICES:
        raise RenderError(f"--role must be one of {', '.join(SERVICES)}, got {settings.role!r}")
    try:
        address = ipaddress.ip_address(settings.ip)
    except ValueError:
        raise RenderError(f"--ip {settings.ip!r} is not an IP address (use the Thunderbolt Bridge address, "
                          f"e.g. 10.0.0.1)") from None
    if address.is_loopback or address.is_unspecified:
        raise RenderError(f"--ip {settings.ip}: a node of a cluster must advertise an address its peers can "
                          f"reach, not {settings.ip}")
    if not os.path.isabs(settings.venv):
        raise RenderError(f"--venv {settings.venv!r} must be an absolute path (launchd has no working directory "
                          f"or PATH to resolve it against)")
    if settings.role == "worker" and not settings.head:
        raise RenderError("--head HEAD_IP[:PORT] is required for a worker (the head's Thunderbolt address)")
    if settings.head:
        host = settings.head_address.rsplit(":", 1)[0]
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise RenderError(f"--head {settings.head!r} must be HEAD_IP or HEAD_IP:PORT") from None
    for flag, port in (("--ray-port", settings.ray_port), ("--ring-base-port", settings.ring_base_port),
                       ("--grpc-base-port", settings.grpc_base_port), ("--port", settings.gateway_port)):
        if not 1024 <= port <= 65535:
            raise RenderError(f"{flag} {port} must be between 1024 and 65535")
    if settings.mlx_units < 1:
        raise RenderError(f"--mlx-units {settings.mlx_units} must be at least 1 (one stage per unit)")
    if settings.python_match_level not in ("minor", "patch"):
        raise RenderError("--python-match-level must be minor or patch")
    for flag, path in (("--auth-token-path", settings.auth_token_path), ("--log-dir", settings.log_dir),
                       ("--state-dir", settings.state_dir), ("--temp-dir", settings.temp_dir),
                       ("--home", settings.home)):
        if path is not None and not os.path.isabs(path):
            raise RenderError(f"{flag} {path!r} must be an absolute path")
    if settings.role != "serve" and settings.serve_args:
        raise RenderError("arguments after -- are stagemesh serve flags; only --role serve takes them")
    return settings


# -- checking ---------------------------------------------------------------------

def check_plist(data: bytes, name: str = "plist") -> list[str]:
    """Problems that would stop the job from working under launchd; [] when it is sound."""
    try:
        job = plistlib.loads(data)
    except Exception as exc:  # plistlib raises InvalidFileException, ExpatError, ValueError
        return [f"{name}: not a valid plist ({exc})"]
    if not isinstance(job, dict):
        return [f"{name}: the top level must be a dict"]
    problems = []
    label = job.get("Label")
    if not isinstance(label, str) or not label:
        problems.append(f"{name}: Label must be a non-empty string")
    argv = job.get("ProgramArguments")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        problems.append(f"{name}: ProgramArguments must be a non-empty list of strings")
        argv = []
    elif not os.path.isabs(argv[0]):
        problems.append(f"{name}: ProgramArguments[0] {argv[0]!r} must be absolute (launchd has no PATH)")
    env = job.get("EnvironmentVariables", {})
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        problems.append(f"{name}: EnvironmentVariables must map strings to strings")
        env = {}
    for key in ("RunAtLoad", "KeepAlive"):
        if job.get(key) is not True:
            problems.append(f"{name}: {key} must be true")
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        value = job.get(key)
        if not (isinstance(value, str) and os.path.isabs(value)):
            problems.append(f"{name}: {key} must be an absolute path")
    if env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "1":
        problems.append(f"{name}: EnvironmentVariables needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (macOS refuses "
                        f"multi-node Ray without it)")
    host_ip = env.get("STAGEMESH_HOST_IP", "")
    if not host_ip:
        problems.append(f"{name}: EnvironmentVariables needs STAGEMESH_HOST_IP (the Thunderbolt address)")
    if env.get("RAY_AUTH_MODE") == "token" and not env.get("RAY_AUTH_TOKEN_PATH"):
        problems.append(f"{name}: RAY_AUTH_MODE=token needs RAY_AUTH_TOKEN_PATH")
    if len(argv) > 2 and argv[1] == "start" and argv[0].endswith("/ray"):
        problems += _check_ray_start(name, argv, host_ip, env)
    elif len(argv) > 1 and argv[1] == "serve":
        if not env.get("RAY_ADDRESS"):
            problems.append(f"{name}: stagemesh serve needs RAY_ADDRESS (the head's HEAD_IP:PORT) to join the "
                            f"cluster; without it, it starts a local Ray on loopback")
        if env.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL") != "minor":
            problems.append(f"{name}: set RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor for a driver joining a cluster")
    else:
        problems.append(f"{name}: ProgramArguments is neither `ray start` nor `stagemesh serve`")
    return problems


def _check_ray_start(name: str, argv: list[str], host_ip: str, env: Mapping[str, str]) -> list[str]:
    problems = []

    def value(flag: str) -> str | None:
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    if "--block" not in argv:
        problems.append(f"{name}: `ray start` needs --block under launchd (otherwise it daemonizes, exits, and "
                        f"KeepAlive restarts it in a loop)")
    node_ip = value("--node-ip-address")
    if not node_ip:
        problems.append(f"{name}: `ray start` needs --node-ip-address (the Thunderbolt address)")
    elif host_ip and node_ip != host_ip:
        problems.append(f"{name}: --node-ip-address {node_ip} differs from STAGEMESH_HOST_IP {host_ip}")
    resources = value("--resources")
    try:
        units = json.loads(resources or "{}").get(MLX_RESOURCE, 0)
    except (ValueError, AttributeError):
        units = 0
        problems.append(f"{name}: --resources {resources!r} is not a JSON object")
    if not units or units < 1:
        problems.append(f"{name}: `ray start` needs --resources='{{\"{MLX_RESOURCE}\": 1}}' (no stage is placed on "
                        f"a node without an '{MLX_RESOURCE}' unit)")
    if "--head" not in argv:
        if not value("--address"):
            problems.append(f"{name}: a worker's `ray start` needs --address HEAD_IP:PORT")
        if env.get("RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL") != "minor":
            problems.append(f"{name}: set RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor on a joining node")
    return problems


def check_files(paths: Sequence[str]) -> int:
    failed = 0
    plutil = shutil.which("plutil")
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            print(f"{path}: {exc.strerror}", file=sys.stderr)
            failed += 1
            continue
        problems = check_plist(data, path)
        if plutil:
            lint = subprocess.run([plutil, "-lint", path], capture_output=True, text=True)
            if lint.returncode != 0:
                problems.append(f"{path}: plutil -lint: {(lint.stdout + lint.stderr).strip()}")
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed += 1
        else:
            print(f"{path}: OK")
    return 1 if failed else 0


# -- acting -------------------------------------------------------------------------

def write_plist(settings: Settings, out_dir: str) -> Path:
    """Write ``<label>.plist`` into ``out_dir`` (atomically); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{settings.label}.plist"
    data = settings.plist_bytes()
    problems = check_plist(data, str(path))
    if problems:  # a bug here, never the user's: the renderer must emit sound jobs
        raise RenderError("; ".join(problems))
    tmp = path.with_suffix(".plist.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def exec_service(settings: Settings, pidfile: str | None = None) -> None:
    """Become the service: its argv and environment, output appended to its log file.

    The process leads a new session (so whoever stops it can find everything it
    started) and writes its pid to ``pidfile`` first; ``execve`` keeps the pid.
    """
    try:
        os.setsid()
    except OSError:  # already a session/group leader
        pass
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env.update(settings.environment())
    Path(settings.logs).mkdir(parents=True, exist_ok=True)
    Path(settings.working_directory).mkdir(parents=True, exist_ok=True)
    os.chdir(settings.working_directory)
    log = os.open(settings.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    argv = settings.program_arguments()
    if pidfile:
        tmp = f"{pidfile}.{os.getpid()}"
        Path(tmp).write_text(f"{os.getpid()}\n")
        os.replace(tmp, pidfile)
    os.execve(argv[0], argv, env)


def write_token(path: str) -> bool:
    """Create a Ray auth token file (0600) unless one exists; True when it wrote one."""
    target = Path(path)
    if target.exists() and target.read_text().strip():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` writes
    return True


# The example sets in deploy/launchd/: two Macs on a Thunderbolt cable, a venv in the user's home.
EXAMPLE_HOME = "/Users/you"
EXAMPLE_VENV = "/Users/you/stagemesh/.venv"
EXAMPLES: dict[str, tuple[Settings, ...]] = {
    "mac-a": (
        Settings("head", "10.0.0.1", EXAMPLE_VENV, home=EXAMPLE_HOME,
                 auth_token_path=f"{EXAMPLE_HOME}/.ray/auth_token"),
        Settings("serve", "10.0.0.1", EXAMPLE_VENV, home=EXAMPLE_HOME,
                 auth_token_path=f"{EXAMPLE_HOME}/.ray/auth_token", serve_args=("-pp", "2")),
    ),
    # Both Macs one stage (-tp 2): Mac B runs the same worker plist.
    "mac-a-tp": (
        Settings("serve", "10.0.0.1", EXAMPLE_VENV, home=EXAMPLE_HOME,
                 auth_token_path=f"{EXAMPLE_HOME}/.ray/auth_token", serve_args=("-tp", "2")),
    ),
    "mac-b": (
        Settings("worker", "10.0.0.2", EXAMPLE_VENV, head="10.0.0.1", home=EXAMPLE_HOME,
                 auth_token_path=f"{EXAMPLE_HOME}/.ray/auth_token"),
    ),
}


def write_examples(out_dir: str) -> list[Path]:
    return [write_plist(s, os.path.join(out_dir, mac)) for mac, settings in EXAMPLES.items() for s in settings]


# -- command line ---------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="render.py", description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- are passed to `stagemesh serve` (role serve).",
    )
    parser.add_argument("--role", choices=sorted(SERVICES))
    parser.add_argument("--ip", help="this node's Thunderbolt address (STAGEMESH_HOST_IP, --node-ip-address)")
    parser.add_argument("--venv", help="absolute path of the virtualenv holding stagemesh and ray")
    parser.add_argument("--head", help="the head's HEAD_IP[:PORT] (worker; serve defaults to --ip)")
    parser.add_argument("--ray-port", type=int, default=DEFAULT_RAY_PORT)
    parser.add_argument("--mlx-units", type=int, default=1, help="'mlx' units this node offers (one per stage)")
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--temp-dir", default=None, help="Ray's --temp-dir (default: Ray's /tmp/ray)")
    parser.add_argument("--ring-base-port", type=int, default=DEFAULT_RING_BASE_PORT)
    parser.add_argument("--grpc-base-port", type=int, default=DEFAULT_GRPC_BASE_PORT)
    parser.add_argument("--port", dest="gateway_port", type=int, default=DEFAULT_GATEWAY_PORT,
                        help="the gateway's port (serve)")
    parser.add_argument("--gateway-host", default=None, help="the gateway's address (serve; default --ip)")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--auth-token-path", default=None,
                      help="Ray token file, the same token on every node (default ~/.ray/auth_token)")
    auth.add_argument("--no-auth", action="store_true",
                      help="RAY_AUTH_MODE=disabled (anyone who reaches the Ray ports can run code)")
    parser.add_argument("--python-match-level", default="minor", choices=("minor", "patch"))
    parser.add_argument("--home", default=str(Path.home()))
    parser.add_argument("--log-dir", default=None, help="default HOME/Library/Logs/stagemesh")
    parser.add_argument("--state-dir", default=None, help="the job's working directory (default HOME/.stagemesh)")
    parser.add_argument("--label-prefix", default=LABEL_PREFIX)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--out", metavar="DIR", help="write <label>.plist into DIR and print its path")
    action.add_argument("--print", dest="show", choices=("plist", "label", "log_path", "command", "argv"),
                        help="print one thing about the service")
    action.add_argument("--exec", action="store_true", help="run the service in the foreground (Linux, tests)")
    parser.add_argument("--pidfile", default=None, help="with --exec: write the service's pid here")
    action.add_argument("--check", nargs="+", metavar="PLIST", help="validate plist files")
    action.add_argument("--write-token", metavar="PATH", help="create a Ray auth token file unless it exists")
    action.add_argument("--examples", metavar="DIR", help="write the example sets (mac-a/, mac-b/) into DIR")
    return parser


def settings_from_args(args: argparse.Namespace, serve_args: Sequence[str]) -> Settings:
    missing = [flag for flag, value in (("--role", args.role), ("--ip", args.ip), ("--venv", args.venv)) if not value]
    if missing:
        raise RenderError(f"{', '.join(missing)} required")
    token = None if args.no_auth else (args.auth_token_path or os.path.join(args.home, ".ray", "auth_token"))
    return validate(Settings(
        role=args.role, ip=args.ip, venv=args.venv.rstrip("/") or "/", head=args.head, ray_port=args.ray_port,
        mlx_units=args.mlx_units, num_cpus=args.num_cpus, temp_dir=args.temp_dir,
        ring_base_port=args.ring_base_port, grpc_base_port=args.grpc_base_port, gateway_port=args.gateway_port,
        gateway_host=args.gateway_host, auth_token_path=token, python_match_level=args.python_match_level,
        home=args.home, log_dir=args.log_dir, state_dir=args.state_dir, label_prefix=args.label_prefix,
        serve_args=tuple(serve_args),
    ))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.check:
            return check_files(args.check)
        if args.write_token:
            wrote = write_token(args.write_token)
            print(f"{'wrote a new' if wrote else 'kept the'} Ray auth token at {args.write_token}")
            return 0
        if args.examples:
            for path in write_examples(args.examples):
                print(path)
            return 0
        settings = settings_from_args(args, serve_args)
        if args.out:
            print(write_plist(settings, args.out))
        elif args.exec:
            exec_service(settings, args.pidfile)  # does not return
        elif args.show == "label":
            print(settings.label)
        elif args.show == "log_path":
            print(settings.log_path)
        elif args.show == "command":
            print(settings.shell_command())
        elif args.show == "argv":
            print(shlex.join(settings.program_arguments()))
        else:
            sys.stdout.write(settings.plist_bytes().decode())
    except RenderError as exc:
        print(f"render.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

