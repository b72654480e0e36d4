"""``stagemesh doctor``: check this node, or every node of the cluster, for the known pitfalls; say how to fix each.

Without ``RAY_ADDRESS`` (or ``--address``) it checks this machine: MLX's backend, the address its stages would
advertise (``STAGEMESH_HOST_IP``: on this node, not loopback, not a VPN tunnel), how its names resolve
(``*.local`` to loopback), the ring / lane / gRPC / gateway ports, and, when ``STAGEMESH_HOST_IP`` says it is
meant for a cluster, Ray's macOS cluster switch and token authentication; with ``--grpc-tls-dir`` (or
``STAGEMESH_GRPC_TLS_DIR``) this node's mesh certificates; ``--tp-link``: a -tp group's link (``tp_link``).

With ``RAY_ADDRESS`` it probes every node in the environment its stages inherit and also reports nodes
without an ``mlx`` unit, too few units for ``-pp`` x ``-dp``, versions that differ across nodes, two nodes
advertising one address, and ports one node cannot reach on another.

Every finding has a severity (ok, info, warning, error), what is wrong and the fix; ``--json`` prints the
findings and the gathered facts. Exit status: 0 when nothing is wrong (warnings allowed unless ``--strict``),
1 when something is, 2 for bad flags (and a ``--tp-backend`` this host's MLX cannot form).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from dataclasses import asdict, dataclass, field

from stagemesh.doctor.checks import (
    ERROR,
    INFO,
    OK,
    SEVERITIES,
    WARNING,
    Finding,
    MeshPlan,
    NodeFacts,
    Reach,
    check_cluster,
    check_join,
    check_node,
    worst,
)
from stagemesh_core import defaults, settings
from stagemesh_core.errors import UserError
from stagemesh_core.plan import TP_BACKENDS
from stagemesh_core.settings import MLX_RESOURCE

_JOIN_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None,
                        help="check the Ray cluster at HEAD_IP:PORT (default $RAY_ADDRESS; unset: this node only)")
    parser.add_argument("--local", action="store_true", help="check only this node, even with RAY_ADDRESS set")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                        help="the -pp you will serve with (default: 1 locally, every 'mlx' unit in a cluster)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=None, help="the -dp you will serve with")
    parser.add_argument("--ring-base-port", type=int, default=None,
                        help=f"default $STAGEMESH_RING_BASE_PORT or {settings.DEFAULT_RING_BASE_PORT}")
    parser.add_argument("--grpc-base-port", type=int, default=None,
                        help=f"default $STAGEMESH_GRPC_BASE_PORT or {settings.DEFAULT_GRPC_BASE_PORT}")
    parser.add_argument("--port", type=int, default=settings.DEFAULT_GATEWAY_PORT,
                        help="the gateway's port (default %(default)s)")
    parser.add_argument("--model", default=None,
                        help="the MODEL you will serve (default: the embedded default model as found here); in a "
                             "cluster every node must have it at the same absolute path")
    parser.add_argument("--grpc-tls-dir", default=None,
                        help="check this node's mesh TLS directory: CA, certificate, key, expiry, names "
                             "(default $STAGEMESH_GRPC_TLS_DIR)")
    parser.add_argument("--json", action="store_true", help="print findings and facts as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only warnings and errors")
    parser.add_argument("--no-resolve", action="store_true",
                        help="skip resolving this host's names (no DNS / mDNS lookups)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for each node's probe (default %(default)s)")
    parser.add_argument("--tp-link", action="store_true",
                        help="also measure the link a -tp group computes over: all-reduce latency of a decode row "
                             "and of a prefill chunk, a -pp hop of the row, each node's memory bandwidth; between "
                             "two local processes, or two 'mlx' nodes of the cluster. `--json > FILE` writes what "
                             "`stagemesh plan --tp-link FILE` reads")
    parser.add_argument("--tp-backend", default=None, choices=TP_BACKENDS,
                        help="with --tp-link: the MLX backend to measure (default ring)")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="with --tp-link: the row's width (default: --model's hidden size)")
    parser.add_argument("--dtype", default=None, choices=("auto", "float32", "float16", "bfloat16"),
                        help="with --tp-link: the row's dtype (default auto: the compute dtype a stage on each node "
                             "picks)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help=f"with --tp-link: rows of the prefill-sized all-reduce (default "
                             f"{defaults.MAX_BATCH_TOKENS}, a prefill chunk)")
    parser.add_argument("--tp-link-iterations", type=int, default=None,
                        help="with --tp-link: timed decode-row all-reduces and hops (default 200)")


@dataclass
class Report:
    mode: str  # "local" or "cluster"
    address: str | None
    plan: MeshPlan
    nodes: list[NodeFacts] = field(default_factory=list)
    reaches: list[Reach] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    tp_link: dict | None = None  # --tp-link's measurement (stagemesh.doctor.tp_link.summarize), or its error

    def failed(self, strict: bool) -> bool:
        level = worst(self.findings)
        return level == ERROR or (strict and level == WARNING)

    def to_json(self, strict: bool) -> dict:
        return {
            "mode": self.mode, "address": self.address, "ok": not self.failed(strict),
            "worst": worst(self.findings), "plan": asdict(self.plan),
            "findings": [asdict(f) for f in self.findings],
            "nodes": [asdict(n) for n in self.nodes],
            "reachability": [asdict(r) for r in self.reaches],
            **({"tp_link": self.tp_link} if self.tp_link is not None else {}),
        }


def _plan(args: argparse.Namespace, units: int | None = None) -> MeshPlan:
    explicit = args.pipeline_parallel_size is not None or args.data_parallel_size is not None
    pp = args.pipeline_parallel_size or 1
    dp = args.data_parallel_size or 1
    if not explicit and units:
        pp = units  # check the ports of the largest mesh the cluster can hold
    return MeshPlan(
        pipeline_parallel_size=pp, data_parallel_size=dp,
        ring_base_port=args.ring_base_port if args.ring_base_port is not None else settings.RING_BASE_PORT,
        grpc_base_port=args.grpc_base_port if args.grpc_base_port is not None else settings.GRPC_BASE_PORT,
        gateway_port=args.port, explicit_size=explicit, model_path=_model_path(args.model),
    )


def _model_path(model: str | None) -> str | None:
    """MODEL as ``stagemesh serve`` would pass it to the stages (an absolute path); never downloads."""
    from stagemesh.doctor.facts import default_model_path

    if model is None:
        return default_model_path()
    expanded = os.path.abspath(os.path.expanduser(model))
    if os.path.exists(expanded) or model.lower().endswith(".gguf") or model.count("/") != 1:
        return expanded
    try:  # an org/name repo id: its snapshot in the local Hugging Face cache, never a download
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception:
        return expanded


def check_local(args: argparse.Namespace) -> Report:
    from stagemesh.doctor.facts import gather_node_facts

    plan = _plan(args)
    meant_for_cluster = bool(settings.HOST_IP) or bool(args.address or settings.RAY_ADDRESS)
    facts = gather_node_facts(plan, cluster=meant_for_cluster, gateway=True, resolve_names=not args.no_resolve)
    findings = check_node(facts, plan, cluster=meant_for_cluster, gateway=True)
    tls_dir = args.grpc_tls_dir or settings.GRPC_TLS_DIR
    if tls_dir:
        from stagemesh.doctor.tls import check_tls_dir

        findings += check_tls_dir(tls_dir, host_ip=settings.HOST_IP)
    report = Report("local", None, plan, [facts], [], findings)
    if getattr(args, "tp_link_config", None) is not None:
        from stagemesh.doctor.tp_link import measure_local

        _add_tp_link(report, measure_local(args.tp_link_config, plan.ring_base_port, plan.grpc_base_port))
    return report


def _add_tp_link(report: Report, measured: dict) -> None:
    """The measurement into the report: its section, and a finding saying what it found."""
    report.tp_link = measured
    if measured.get("error"):
        report.findings.append(Finding("tp-link", ERROR, "", f"{measured['backend']} link not measured: "
                                       f"{measured['error']}", "fix that and run doctor --tp-link again"))
        return
    ar, hop = measured["allreduce_us"], measured["hop_us"]
    report.findings.append(Finding("tp-link", OK, "", (
        f"{measured['backend']} between {' and '.join(measured['hosts'])}: all-reduce of "
        f"[1, {measured['hidden_size']}] "
        f"{measured['dtype']} {ar['decode']['median']:.1f} us median (p90 {ar['decode']['p90']:.1f}), of "
        f"[{measured['prefill_rows']}, {measured['hidden_size']}] {ar['prefill']['median']:.1f} us "
        f"({measured['prefill_bandwidth_gbs']:.2f} GB/s); a -pp hop of the row {hop['median']:.1f} us; memory "
        f"bandwidth {' and '.join(f'{b:.1f}' for b in measured['memory_bandwidth_gbs'])} GB/s")))


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.split("://")[-1].rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else (address, 6379)


def check_cluster_at(address: str, args: argparse.Namespace) -> Report:
    """Join the cluster, probe every node, check; never leaves an actor behind."""
    host, port = _split_address(address)
    try:  # fail in seconds, not after Ray's own retries, when nothing listens there
        socket.create_connection((host, port), timeout=_JOIN_TIMEOUT_S).close()
    except OSError as exc:
        return Report("cluster", address, _plan(args),
                      findings=check_join(address, exc.strerror or str(exc), reachable=False))
    # A driver on a Mac needs Ray's cluster switch like every other process of the cluster (it is
    # read when Ray is imported); it changes nothing on Linux, where it is the default.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    import ray

    from coordinator.ray_cluster import RayStartError, connect_ray, disconnect
    from stagemesh.doctor.facts import auth_token

    try:
        session = connect_ray(0, address=address)
    except RayStartError as exc:
        cause = exc.__cause__ or exc
        _, present = auth_token()
        return Report("cluster", address, _plan(args), findings=check_join(
            address, str(cause).splitlines()[0], reachable=True, auth_mode=os.environ.get("RAY_AUTH_MODE"),
            token_present=present))
    try:
        return _probe_cluster(ray, address, args)
    finally:
        disconnect(session)


def _probe_cluster(ray, address: str, args: argparse.Namespace) -> Report:
    """Run a small probe pinned to every node (``NodeAffinitySchedulingStrategy``), so each node reports its own
    facts in the environment Ray gives its workers (the one the stages inherit); the probes also listen on each
    node's ports while the other nodes connect to them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from stagemesh.doctor.facts import NodeProbe

    alive = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    head_id = next((n["NodeID"] for n in alive if "node:__internal_head__" in n.get("Resources", {})), None)
    units = {n["NodeID"]: int(n.get("Resources", {}).get(MLX_RESOURCE, 0)) for n in alive}
    plan = _plan(args, sum(units.values()))
    probe_class = ray.remote(num_cpus=0, max_restarts=0)(NodeProbe)
    actors = {
        n["NodeID"]: probe_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote()
        for n in alive
    }
    try:
        refs = {
            n["NodeID"]: actors[n["NodeID"]].facts.remote(
                plan, n["NodeID"], n["NodeManagerAddress"], units[n["NodeID"]], n["NodeID"] == head_id,
                not args.no_resolve)
            for n in alive
        }
        nodes: dict[str, NodeFacts] = {}
        for n in alive:
            node_id = n["NodeID"]
            try:
                nodes[node_id] = ray.get(refs[node_id], timeout=args.timeout)
            except Exception as exc:  # the probe could not start or run there
                nodes[node_id] = NodeFacts(
                    hostname="", node_id=node_id, ray_address=n["NodeManagerAddress"], mlx_units=units[node_id],
                    is_head=node_id == head_id, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        reaches = _reachability(ray, actors, nodes, plan, args.timeout)
    finally:
        for actor in actors.values():
            try:
                ray.get(actor.close.remote(), timeout=5)
            except Exception:
                pass
            ray.kill(actor)
    measured = None
    if getattr(args, "tp_link_config", None) is not None:  # after the probes: they listened on stage ports
        from stagemesh.doctor.tp_link import measure_cluster

        measured = measure_cluster(ray, alive, args.tp_link_config, plan.ring_base_port, plan.grpc_base_port)
    ordered = sorted(nodes.values(), key=lambda f: (not f.is_head, f.advertised or ""))
    report = Report("cluster", address, plan, ordered, reaches, check_cluster(ordered, plan, reaches))
    if measured is not None:
        _add_tp_link(report, measured)
    return report


def _reachability(ray, actors: dict, nodes: dict[str, NodeFacts], plan: MeshPlan, timeout: float) -> list[Reach]:
    """Each node listens on its free stage ports; every other node connects to them."""
    probed = {nid: f for nid, f in nodes.items()
              if not f.error and not f.port_error and f.advertised and nid in actors}
    if len(probed) < 2:
        return []
    listening_refs = {nid: actors[nid].listen.remote(f.advertised, plan.stage_ports()) for nid, f in probed.items()}
    listening = {nid: ray.get(ref, timeout=timeout) for nid, ref in listening_refs.items()}
    connect_refs = {}
    for src in probed:
        targets = [(probed[dst].label, probed[dst].advertised, port)
                   for dst in probed if dst != src for port in listening[dst]]
        connect_refs[src] = actors[src].connect.remote(targets)
    reaches = []
    for src, ref in connect_refs.items():
        for dst_label, host, port, result in ray.get(ref, timeout=timeout):
            reaches.append(Reach(probed[src].label, dst_label, host, port, result))
    return reaches


def tp_link_config(args: argparse.Namespace):
    """``--tp-link``'s ``TpLinkConfig`` (None without it); ``UserError`` for its flags without it, a hidden
    size nobody can tell, or a backend this host's MLX cannot form (refused here, as serve refuses it)."""
    from stagemesh.doctor.tp_link import TpLinkConfig, check_backend

    given = [flag for flag, value in (("--tp-backend", args.tp_backend), ("--hidden-size", args.hidden_size),
                                      ("--dtype", args.dtype), ("--prefill-rows", args.prefill_rows),
                                      ("--tp-link-iterations", args.tp_link_iterations)) if value is not None]
    if not args.tp_link:
        if given:
            raise UserError(f"{', '.join(given)} only apply with --tp-link")
        return None
    hidden = args.hidden_size
    if hidden is None:
        hidden = _model_hidden_size(args.model)
    config = TpLinkConfig(
        backend=args.tp_backend or "ring", hidden_size=hidden, dtype=args.dtype or "auto",
        prefill_rows=defaults.MAX_BATCH_TOKENS if args.prefill_rows is None else args.prefill_rows,
        iterations=200 if args.tp_link_iterations is None else args.tp_link_iterations, timeout_s=args.timeout)
    check_backend(config.backend)
    return config


def _model_hidden_size(model: str | None) -> int:
    """The hidden size of the MODEL doctor is told about (the embedded default without one)."""
    path = _model_path(model)
    if not path or not os.path.exists(path):
        raise UserError(f"--tp-link: no model at {path or 'the embedded default'} to take the hidden size from; "
                        "give --hidden-size N (the model's hidden_size) or --model")
    from stage_worker.checkpoint.model_reader import read_model_spec

    try:
        return read_model_spec(path).hidden_size
    except Exception as exc:
        raise UserError(f"--tp-link: cannot read {path}'s hidden size ({exc}); give --hidden-size N") from None


# -- output -----------------------------------------------------------------------------

_TAGS = {OK: "ok", INFO: "info", WARNING: "WARN", ERROR: "ERROR"}


def format_report(report: Report, *, quiet: bool = False) -> str:
    plan = report.plan
    where = (f"the Ray cluster at {report.address}, {len(report.nodes)} node(s)" if report.mode == "cluster"
             else "this node")
    lines = [f"stagemesh doctor: {where}; ports for -pp {plan.pipeline_parallel_size} -dp "
             f"{plan.data_parallel_size} (ring base {plan.ring_base_port}, gRPC base {plan.grpc_base_port}, "
             f"gateway {plan.gateway_port})"]
    shown = [f for f in report.findings if not quiet or f.severity in (WARNING, ERROR)]
    check_width = max((len(f.check) for f in shown), default=0)
    for finding in sorted(shown, key=lambda f: -SEVERITIES.index(f.severity)) if quiet else shown:
        node = f"[{finding.node}] " if finding.node else ""
        lines.append(f"  {_TAGS[finding.severity]:<5} {finding.check:<{check_width}}  {node}{finding.problem}")
        if finding.fix and finding.severity in (WARNING, ERROR):
            lines.append(f"  {'':<5} {'':<{check_width}}  fix: {finding.fix}")
    counts = {s: sum(1 for f in report.findings if f.severity == s) for s in (ERROR, WARNING)}
    if counts[ERROR] or counts[WARNING]:
        lines.append(f"{counts[ERROR]} error(s), {counts[WARNING]} warning(s): each has its fix above")
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for flag, value in (("-pp", args.pipeline_parallel_size), ("-dp", args.data_parallel_size)):
        if value is not None and value < 1:
            print(f"stagemesh doctor: error: {flag} must be at least 1", file=sys.stderr)
            return 2
    try:
        args.tp_link_config = tp_link_config(args)
    except UserError as exc:
        print(f"stagemesh doctor: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    address = None if args.local else (args.address or settings.RAY_ADDRESS)
    report = check_cluster_at(address, args) if address else check_local(args)
    if args.json:
        print(json.dumps(report.to_json(args.strict), indent=2))
    else:
        print(format_report(report, quiet=args.quiet))
    return 1 if report.failed(args.strict) else 0


__all__ = ["add_arguments", "run", "Report", "check_local", "check_cluster_at", "format_report", "tp_link_config"]
