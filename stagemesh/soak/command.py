"""``stagemesh soak``: hold N streaming clients against a mesh for a while, injecting faults, and judge it.

It starts ``stagemesh serve`` itself on this machine (the embedded default model unless ``--model``;
``-pp``/``-dp``; anything after ``--`` goes to serve), waits until it is healthy, runs ``--streams`` clients
for ``--duration`` seconds and, after a warm-up, injects a fault (``kill``, ``stop``, ``block``, in turn) at a
random stage of each replica in turn every ``--fault-interval`` seconds, one at a time: the next waits until
the faulted replica is whole again. Resident memory and open descriptors of serve (gateway + coordinator) and
of every stage are taken after the warm-up and after the load. Then it stops serve and prints the verdict;
``--json`` writes it. Exit 0 when the run passed, 1 when not, 2 for bad flags.

A replica faulted before it has served ``coordinator.supervision.STABLE_AFTER_S`` in one go since its last
failure restarts only after a growing backoff, which the recovery times would count. So the default interval
gives each replica that long between faults, and a ``--fault-interval`` shorter than ``STABLE_AFTER_S / dp``
is refused unless ``--allow-backoff``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from coordinator.supervision import STABLE_AFTER_S
from stagemesh.soak.clients import run_clients
from stagemesh.soak.faults import KINDS, MeshWatch, block_available, inject
from stagemesh.soak.report import FaultRecord, ProcessSample, format_report, judge
from stagemesh_core import settings
from stagemesh_core.errors import UserError

MODEL = "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default %(default)s)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streaming clients (default %(default)s)")
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2, dest="pp")
    parser.add_argument("-dp", "--data-parallel-size", type=int, default=1, dest="dp")
    parser.add_argument("--model", default=None, help="MODEL for serve (default: the embedded default)")
    parser.add_argument("--faults", default="kill,stop,block",
                        help="fault kinds to draw from: kill, stop, block (default %(default)s; block needs root "
                             "and iptables and is left out, with a note, where it cannot work)")
    parser.add_argument("--fault-interval", type=float, default=None,
                        help=f"seconds between a recovery and the next fault (default: {STABLE_AFTER_S:g} / dp, "
                             f"the least that lets each replica count as stable again, so it restarts at once)")
    parser.add_argument("--hold", type=float, default=8.0, help="seconds a stop or block lasts (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the first fault and the "
                                                                   "start sample (default %(default)s)")
    parser.add_argument("--stall", type=float, default=60.0,
                        help="a request silent this long (no byte) counts as hung (default %(default)s)")
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="a request running longer than this counts as hung, moving or not (default %(default)s)")
    parser.add_argument("--max-recovery", type=float, default=60.0, help="worst recovery allowed (default 60 s)")
    parser.add_argument("--port", type=int, default=settings.DEFAULT_GATEWAY_PORT)
    parser.add_argument("--grpc-base-port", type=int, default=settings.DEFAULT_GRPC_BASE_PORT)
    parser.add_argument("--ring-base-port", type=int, default=settings.DEFAULT_RING_BASE_PORT)
    parser.add_argument("--seed", type=int, default=0, help="the fault schedule's random seed")
    parser.add_argument("--allow-backoff", "--allow-give-up", action="store_true", dest="allow_backoff",
                        help="allow a shorter fault interval, after which the coordinator backs off its restarts")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    parser.add_argument("--log-dir", default=None, help="keep serve's log here (default: a temporary directory)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then extra `stagemesh serve` flags")


def _fault_kinds(args: argparse.Namespace) -> tuple[list[str], str]:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    for kind in kinds:
        if kind not in KINDS:
            raise UserError(f"--faults: unknown fault {kind!r}; choose from {', '.join(KINDS)}")
    note = ""
    if "block" in kinds:
        ok, why = block_available()
        if not ok:
            kinds.remove("block")
            note = f"block left out: it {why}"
    return kinds, note


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--duration", args.duration), ("--streams", args.streams), ("-pp", args.pp),
                        ("-dp", args.dp), ("--deadline", args.deadline), ("--stall", args.stall)):
        if value <= 0:
            raise UserError(f"{flag} must be positive, got {value}")
    floor = STABLE_AFTER_S / args.dp
    if args.fault_interval is None:
        args.fault_interval = floor
    if args.fault_interval < floor and not args.allow_backoff:
        raise UserError(f"--fault-interval {args.fault_interval:g}: each replica would be faulted again within "
                        f"{STABLE_AFTER_S:g} s of recovering, and the coordinator would wait out a backoff before "
                        f"restarting it; use at least {floor:g} s at -dp {args.dp}, or --allow-backoff")


def _start_serve(args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    extra = [a for a in args.serve_args if a != "--"]
    command = [sys.executable, "-m", "stagemesh.cli", "serve", *([args.model] if args.model else []),
               "-pp", str(args.pp), "-dp", str(args.dp), "--port", str(args.port),
               "--grpc-base-port", str(args.grpc_base_port), "--ring-base-port", str(args.ring_base_port), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_healthy(url: str, serve: subprocess.Popen, log_path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"serve exited with {serve.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve was not healthy within {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")


def _sample(serve_pid: int, watch: MeshWatch) -> list[ProcessSample]:
    samples = []
    named = [("gateway", serve_pid)] + [(f"replica {r['replica']} stage {s['rank']}", s["pid"])
                                        for r in watch.mesh().get("replicas", []) for s in r["stages"] if s.get("pid")]
    for name, pid in named:
        try:
            process = psutil.Process(pid)
            samples.append(ProcessSample(name, pid, process.memory_info().rss, process.num_fds()))
        except psutil.Error:
            continue  # it is being replaced right now
    return samples


class FaultLoop:
    """Injects faults one at a time in a thread, until ``stop()``; ``records`` is what happened."""

    def __init__(self, args: argparse.Namespace, kinds: list[str], watch: MeshWatch, t0: float) -> None:
        self._args, self._kinds, self._watch, self._t0 = args, kinds, watch, t0
        self._rng = random.Random(args.seed)
        self._rng.shuffle(self._kinds)
        self._stop = threading.Event()
        self.records: list[FaultRecord] = []
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def clock(self) -> float:
        return time.monotonic() - self._t0

    def start(self) -> FaultLoop:
        self._thread.start()
        return self

    def stop(self, recover_timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(recover_timeout_s + self._args.hold + 10)

    def _run(self) -> None:
        # A moment after the warm-up, so the start sample (taken at the warm-up) sees the mesh unfaulted.
        if self._stop.wait(self._args.warmup + 3) or not self._kinds:
            return
        total = self._args.pp * self._args.dp
        while not self._stop.is_set():
            targets = self._watch.targets(total) if self._watch.all_healthy() else []
            if not targets:
                self._stop.wait(0.5)
                continue
            # Kinds in turn (a seeded order), replicas in turn, a random stage of it: a short run still meets
            # every kind, and no replica takes more than its share of the coordinator's restart cap.
            replica = len(self.records) % self._args.dp
            target = self._rng.choice([t for t in targets if t.replica == replica] or targets)
            kind = self._kinds[len(self.records) % len(self._kinds)]
            old_pids = {t.pid for t in targets if t.replica == target.replica}
            injected = self.clock()
            try:
                inject(kind, target, self._args.hold)
            except (psutil.Error, subprocess.CalledProcessError) as exc:
                print(f"soak: could not inject {kind} into pid {target.pid}: {exc}", file=sys.stderr)
                self._stop.wait(1)
                continue
            ended = self.clock()
            recovered = self._watch.wait_recovered(target.replica, old_pids, ended, 300, self.clock)
            self.records.append(FaultRecord(kind, target.replica, target.rank, target.pid, round(injected, 2),
                                            round(ended, 2), None if recovered is None else round(recovered, 2)))
            print(f"soak: {kind} replica {target.replica} stage {target.rank} at {injected:.0f} s -> "
                  f"{'recovered in %.1f s' % (recovered - injected) if recovered is not None else 'not recovered'}",
                  file=sys.stderr)
            if recovered is None:
                errors = {s.get("error") for s in self._watch.mesh().get("replicas", [{}])[target.replica]
                          .get("stages", []) if s.get("error")}
                print(f"soak: replica {target.replica} did not come back: {'; '.join(sorted(errors)) or 'no error'}",
                      file=sys.stderr)
                return  # nothing more to learn from faulting a mesh that did not come back
            self._stop.wait(self._args.fault_interval)


def _stop_serve(serve: subprocess.Popen) -> None:
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def run(args: argparse.Namespace) -> int:
    _check(args)
    kinds, note = _fault_kinds(args)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="stagemesh-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "serve.log"
    url = f"http://127.0.0.1:{args.port}"
    serve = _start_serve(args, log_path)
    print(f"soak: serve -pp {args.pp} -dp {args.dp} starting (log {log_path})", file=sys.stderr)
    try:
        _wait_healthy(url, serve, log_path)
        watch = MeshWatch(url).start()
        t0 = time.monotonic()
        faults = FaultLoop(args, kinds, watch, t0).start()
        start_sample: list[ProcessSample] = []

        def take_start_sample() -> None:
            start_sample.extend(_sample(serve.pid, watch))

        timer = threading.Timer(min(args.warmup, args.duration), take_start_sample)
        timer.start()
        records = asyncio.run(run_clients(url, MODEL, None, args.streams, args.duration, args.deadline, t0,
                                          stall_s=args.stall))
        timer.join()
        faults.stop(recover_timeout_s=300)
        watch.wait_until_whole(120)
        end_sample = _sample(serve.pid, watch)
        duration = time.monotonic() - t0
        watch.stop()
    finally:
        _stop_serve(serve)
    config = {"pp": args.pp, "dp": args.dp, "streams": args.streams, "duration_s": args.duration,
              "faults": kinds, "fault_interval_s": args.fault_interval, "hold_s": args.hold, "seed": args.seed,
              "stall_s": args.stall, "deadline_s": args.deadline,
              "note": note, "cpus": os.cpu_count()}
    report = judge(config, duration, records, faults.records, start_sample, end_sample,
                   max_recovery_s=args.max_recovery)
    print(format_report(report))
    if note:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.passed else 1
