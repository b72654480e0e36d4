"""``stagemesh doctor --tp-link``: measure the link a tensor-parallel group computes over, as its workers would.

Two processes form the MLX group of a one-stage ``-tp 2`` plan (``probe_plan``) through the stages' own
``stage_worker.transport.group.join_group`` (hostfile or rendezvous from the plan, ``--tp-backend``), on the
group ports that plan gives at ``--ring-base-port``; then each times ``all_sum`` of a decode row
(``[1, hidden]`` in the compute dtype) and of a prefill chunk (``[rows, hidden]``), a -pp hop of the row
over TCP between the same two addresses (the lane's transport), and its node's memory bandwidth as a
decode step's matrix-vector product streams it. Locally the two are subprocesses on loopback; in a Ray
cluster, actors pinned to two nodes holding ``mlx`` units (``measure_cluster``). ``check_backend`` refuses,
before anything starts, a backend this host's MLX cannot form. ``summarize`` (pure) turns the members'
samples into the report's ``tp_link`` section, which ``stagemesh plan --tp-link FILE`` reads
(``stagemesh_core.tp_cost.link_from_doctor``).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from stagemesh_core.errors import UserError
from stagemesh_core.layer_split import LayerRange
from stagemesh_core.plan import PipelinePlan, StagePlacement, with_groups
from stagemesh_core.ports import stage_ports

BANDWIDTH_BYTES = 256 * 2**20  # larger than any chip's caches, small enough for any node
_CONNECT_S = 10.0


@dataclass(frozen=True)
class TpLinkConfig:
    """What to measure: the backend, the row (hidden size, dtype: "auto" resolves on each node as a stage's
    ``--dtype auto`` does), the prefill chunk's rows, how many timed all-reduces, and the deadline."""

    backend: str = "ring"
    hidden_size: int = 576
    dtype: str = "auto"
    prefill_rows: int = 512
    iterations: int = 200
    warmup: int = 20
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "prefill_rows", "iterations"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


def check_backend(backend: str, env: Mapping[str, str] | None = None) -> None:
    """Refuse (``UserError``) a backend this host's MLX cannot form, as ``stagemesh serve`` refuses it, and
    jaccl without the RDMA device file every member needs (the check ``join_group`` makes at start)."""
    from stagemesh.serve import backend_ready

    try:
        backend_ready(backend)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    source = os.environ if env is None else env
    if backend == "jaccl" and not source.get("MLX_IBV_DEVICES"):
        raise UserError("--tp-backend jaccl needs MLX_IBV_DEVICES on every node of the group (the RDMA device file "
                        "`mlx.distributed_config --backend jaccl` writes); set it or use --tp-backend ring")


def probe_plan(hosts: tuple[str, str], backend: str, ring_base_port: int, grpc_base_port: int) -> PipelinePlan:
    """The one-stage ``-tp 2`` plan whose group the probe forms: worker 0 on ``hosts[0]``, member 1 on
    ``hosts[1]``, on the ports such a mesh would use (pure). It names no model: nothing is loaded."""
    ports = stage_ports(0, 1, ring_base_port, grpc_base_port)
    stage = StagePlacement(rank=0, global_index=0, layers=LayerRange(0, 1), host=hosts[0], ring_port=ports.ring,
                           lane_port=ports.lane, grpc_port=ports.grpc)
    leaders, members = with_groups((stage,), {(0, 1): hosts[1]}, 1, 2, ring_base_port, grpc_base_port)
    return PipelinePlan(replica=0, model_path="", num_layers=1, compute_dtype="auto", stages=leaders,
                        tensor_parallel_size=2, tp_backend=backend, members=members)


def percentiles_us(samples_s: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile of ``samples_s`` (seconds) in microseconds (pure)."""
    ordered = sorted(samples_s)
    if not ordered:
        raise ValueError("no samples")

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 2)

    return {"median": round(statistics.median(ordered) * 1e6, 2), "p10": at(0.1), "p90": at(0.9),
            "samples": len(ordered)}


def summarize(results: Sequence[Mapping[str, Any]], hosts: Sequence[str], config: TpLinkConfig,
              mode: str) -> dict[str, Any]:
    """The report's ``tp_link`` section from both members' results (member 0's timings; both bandwidths)."""
    leader = results[0]
    row_bytes = config.hidden_size * leader["itemsize"]
    prefill = percentiles_us(leader["prefill_s"])
    return {
        "mode": mode, "backend": config.backend, "hosts": list(hosts), "hidden_size": config.hidden_size,
        "dtype": leader["dtype"], "device": leader["device"], "prefill_rows": config.prefill_rows,
        "allreduce_us": {"decode": percentiles_us(leader["decode_s"]), "prefill": prefill},
        # Bytes of the message over the all-reduce's time (nccl-tests' "algorithm bandwidth").
        "prefill_bandwidth_gbs": round(row_bytes * config.prefill_rows / (prefill["median"] * 1e3), 3),
        "hop_us": percentiles_us([rtt / 2 for rtt in leader["hop_rtt_s"]]),
        "memory_bandwidth_gbs": [r["bandwidth_gbs"] for r in results],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


# -- one member (a subprocess or a Ray actor) ------------------------------------------------------------


def measure_member(plan: PipelinePlan, member: int, config: TpLinkConfig) -> dict[str, Any]:
    """Join the probe plan's group as ``member`` and time it (see the module); member 0's dict has the link's
    samples, both have their node's bandwidth. Blocks until the other member joins (within the deadline)."""
    import mlx.core as mx

    from stage_worker.model.device import probe
    from stage_worker.transport.group import join_group
    from stage_worker.transport.links import RingWatchdog
    from stagemesh_core.memory import resolved_dtype

    device = probe()
    dtype_name = resolved_dtype(config.dtype, device.backend)
    dtype = getattr(mx, dtype_name)
    bandwidth = _bandwidth_gbs(mx, dtype, config.hidden_size)
    watchdog = RingWatchdog(config.timeout_s, f"doctor --tp-link member {member}")
    try:
        group = join_group(plan, 0, member, watchdog)

        def timed(rows: int, count: int) -> list[float]:
            x = mx.zeros((rows, config.hidden_size), dtype=dtype)  # zeros: sums never overflow
            mx.eval(x)
            samples = []
            for i in range(config.warmup + count):
                started = time.perf_counter()
                with watchdog.guard("an all-reduce"):
                    x = mx.distributed.all_sum(x, group=group)
                    mx.eval(x)
                if i >= config.warmup:
                    samples.append(time.perf_counter() - started)
            return samples

        decode = timed(1, config.iterations)
        prefill = timed(config.prefill_rows, max(10, config.iterations // 10))
        hop = _hop_round_trips(mx, group, plan, member, config, config.hidden_size * dtype.size, watchdog)
    finally:
        watchdog.close()
    return {"member": member, "dtype": dtype_name, "itemsize": dtype.size, "device": f"{device.backend} "
            f"{device.name}".strip(), "bandwidth_gbs": bandwidth, "decode_s": decode, "prefill_s": prefill,
            "hop_rtt_s": hop}


def _bandwidth_gbs(mx: Any, dtype: Any, hidden: int) -> float:
    """GB/s this node streams weights at through a decode step's matrix-vector product (the median of 5)."""
    weight = mx.ones((BANDWIDTH_BYTES // (hidden * dtype.size), hidden), dtype=dtype)
    x = mx.ones((1, hidden), dtype=dtype)
    mx.eval(weight, x)
    times = []
    for _ in range(6):
        started = time.perf_counter()
        mx.eval(x @ weight.T)
        times.append(time.perf_counter() - started)
    return round(weight.nbytes / statistics.median(times[1:]) / 1e9, 2)


def _hop_round_trips(mx: Any, group: Any, plan: PipelinePlan, member: int, config: TpLinkConfig, nbytes: int,
                     watchdog: Any) -> list[float]:
    """Round trips of one ``nbytes`` row over TCP (no Nagle, as the lanes) from member 0 to member 1's mirror
    lane port: member 1 listens before the group's barrier, member 0 connects after it."""
    target = plan.worker(0, 1)
    listener = None
    if member == 1:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((target.host, target.lane_port))
        listener.listen(1)
    with watchdog.guard("the hop's barrier"):
        mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group))
    payload = bytearray(nbytes)
    count = config.warmup + config.iterations
    samples: list[float] = []
    if listener is not None:
        listener.settimeout(config.timeout_s)
        conn, _ = listener.accept()
        listener.close()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(config.timeout_s)
            for _ in range(count):
                _recv_exact(conn, payload)
                conn.sendall(payload)
        return samples
    with socket.create_connection((target.host, target.lane_port), timeout=_CONNECT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(config.timeout_s)
        for i in range(count):
            started = time.perf_counter()
            sock.sendall(payload)
            _recv_exact(sock, payload)
            if i >= config.warmup:
                samples.append(time.perf_counter() - started)
    return samples


def _recv_exact(sock: socket.socket, buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the other member closed the hop's connection")
        got += n


# -- two local processes ------------------------------------------------------------------------------


def measure_local(config: TpLinkConfig, ring_base_port: int, grpc_base_port: int) -> dict[str, Any]:
    """Both members as subprocesses of this one on loopback; the report's ``tp_link`` section, or
    ``{"error": ...}`` naming what failed."""
    hosts = ("127.0.0.1", "127.0.0.1")
    plan = probe_plan(hosts, config.backend, ring_base_port, grpc_base_port)
    busy = [f"{w.host}:{p}" for w in plan.workers for p in (w.group_port, w.lane_port) if not _free(w.host, p)]
    if busy:
        return {"error": f"ports {', '.join(busy)} are in use (a mesh serving there?): choose another "
                         "--ring-base-port for the measurement", "backend": config.backend}
    body = json.dumps({"plan": json.loads(plan.to_json()), "config": asdict(config)})
    procs = [subprocess.Popen([sys.executable, "-m", "stagemesh.doctor.tp_link", body, str(member)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for member in (0, 1)]
    outputs: list[tuple[str, str]] = []
    try:
        deadline = time.monotonic() + config.timeout_s + 60  # the timings' own deadline, plus MLX's start
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        return {"error": f"the two members did not finish within {config.timeout_s + 60:.0f} s", "backend":
                config.backend}
    failed = [(p.returncode, err) for p, (_, err) in zip(procs, outputs) if p.returncode]
    if failed:
        code, err = failed[0]
        last = (err.strip().splitlines() or [f"exit {code}"])[-1]
        return {"error": f"a member exited with {code}: {last[:300]}", "backend": config.backend}
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    return summarize(results, hosts, config, "local")


def _free(host: str, port: int) -> bool:
    from stagemesh_core.ports import port_is_free

    return port_is_free(host, port)


# -- two nodes of a Ray cluster -------------------------------------------------------------------


class TpLinkMember:
    """One member on its node (a Ray actor pinned there, holding no ``mlx`` unit so a serving mesh keeps its
    own); used once: a process joins one MLX group."""

    def address(self, fallback: str) -> str:
        """The address this node's stages advertise: ``STAGEMESH_HOST_IP``, else its Ray address."""
        return os.environ.get("STAGEMESH_HOST_IP", "").strip() or fallback

    def check(self, backend: str) -> str | None:
        try:
            check_backend(backend)
        except UserError as exc:
            return str(exc)
        return None

    def measure(self, plan_json: str, member: int, config: dict[str, Any]) -> dict[str, Any]:
        return measure_member(PipelinePlan.from_json(plan_json), member, TpLinkConfig(**config))


def measure_cluster(ray: Any, nodes: Sequence[Mapping[str, Any]], config: TpLinkConfig, ring_base_port: int,
                    grpc_base_port: int) -> dict[str, Any]:
    """Between the first two alive nodes holding ``mlx`` units (the head first); ``{"error": ...}`` where the
    cluster has fewer, a node cannot form the backend, or the measurement fails."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stagemesh_core.settings import MLX_RESOURCE

    holding = sorted((n for n in nodes if n.get("Resources", {}).get(MLX_RESOURCE, 0) > 0),
                     key=lambda n: "node:__internal_head__" not in n.get("Resources", {}))
    if len(holding) < 2:
        return {"error": f"{len(holding)} node(s) hold an 'mlx' unit; a link needs two (start the other Mac with "
                         "ray start ... --resources='{\"mlx\": 1}')", "backend": config.backend}
    pair = holding[:2]
    member_class = ray.remote(num_cpus=0, max_restarts=0)(TpLinkMember)
    actors = [member_class.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n["NodeID"], soft=False)).remote() for n in pair]
    try:
        refusals = ray.get([a.check.remote(config.backend) for a in actors], timeout=config.timeout_s)
        for node, refusal in zip(pair, refusals):
            if refusal:
                return {"error": f"[{node['NodeManagerAddress']}] {refusal}", "backend": config.backend}
        hosts = tuple(ray.get([a.address.remote(n["NodeManagerAddress"]) for a, n in zip(actors, pair)],
                              timeout=config.timeout_s))
        plan = probe_plan((hosts[0], hosts[1]), config.backend, ring_base_port, grpc_base_port)
        refs = [a.measure.remote(plan.to_json(), m, asdict(config)) for m, a in enumerate(actors)]
        results = ray.get(refs, timeout=config.timeout_s + 60)
    except Exception as exc:  # an actor that could not start, a member that timed out or lost its peer
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", "backend": config.backend}
    finally:
        for actor in actors:
            ray.kill(actor)
    return summarize(results, hosts, config, "cluster")


def _main(argv: Sequence[str]) -> int:
    """``python -m stagemesh.doctor.tp_link BODY MEMBER``: one local member; its result as JSON on stdout."""
    body = json.loads(argv[0])
    plan = PipelinePlan.from_dict(body["plan"])
    result = measure_member(plan, int(argv[1]), TpLinkConfig(**body["config"]))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
