"""``stagemesh bench hop``: where the time of one pipeline hop goes, on whatever device MLX runs.

Starts two processes on loopback (MLX ring ranks 0 and 1, plus a plain TCP socket between them, as a stage's
control lane is) and, for each ``--rows`` payload, times round trips of a ``[rows, hidden]`` array of
``--dtype`` (auto: what a stage computes in on this backend) computed on the default device (GPU where there
is one): ``ring``, over ``mx.distributed.send`` / ``recv`` as stages pass hidden states with
``--hop-transport ring``, and ``lane``, the same bytes over the TCP socket through host memory. Rank 0 alone
also times the parts: the ``[rows, hidden] @ [hidden, hidden]`` product each side computes (``compute``; a
round trip holds two), evaluating a small op on the device (``sync``), copying the array to host memory
(``to_host``) and creating it on the device from host bytes (``from_host``). Each figure is the median of
``--iters`` after ``--warmup``; the report's ratios give the lane's round trip over the ring's for each shape.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stagemesh.bench import flags
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=2048,
                        help="hidden size (2048: Llama 3.2 1B; 4096: 8B) (default %(default)s)")
    parser.add_argument("--rows", default="1,16,64",
                        help="rows per payload (tokens in a batch), comma-separated (default %(default)s)")
    flags.add_dtype(parser)
    parser.add_argument("--iters", type=int, default=200, help="measured round trips per shape (default %(default)s)")
    flags.add_warmup(parser, 20, "N round trips per shape")
    flags.add_port_base(parser, 29310, "two ring ports and one lane port")


def run(args: argparse.Namespace) -> int:
    from stagemesh.bench.report import build_report, emit, flags_of, now

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if not rows or min(rows) < 1 or args.hidden < 1 or args.iters < 1 or args.warmup < 0:
        raise UserError("--rows, --hidden and --iters must be positive, --warmup not negative")
    from stage_worker.model.stage_model import resolve_compute_dtype
    from stage_worker.transport.wire import dtype_name

    try:  # the hidden states a stage would pass on this backend
        dtype = dtype_name(resolve_compute_dtype(args.dtype))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    started_at = now()
    with tempfile.TemporaryDirectory(prefix="stagemesh-hop-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{args.port_base}"], [f"127.0.0.1:{args.port_base + 1}"]]))
        config = {"hidden": args.hidden, "rows": rows, "dtype": dtype, "iters": args.iters,
                  "warmup": args.warmup, "lane_port": args.port_base + 2, "result": str(Path(tmp) / "result.json")}
        procs = []
        for rank in (0, 1):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            procs.append(subprocess.Popen([sys.executable, "-m", "stagemesh.bench.hop", json.dumps(config)],
                                          env=env))
        codes = [p.wait(600) for p in procs]
        if any(codes):
            print(f"stagemesh bench hop: ranks exited with {codes}", file=sys.stderr)
            return 1
        result = json.loads(Path(config["result"]).read_text())
    result.pop("mlx")  # the environment names MLX's version
    report = build_report("hop", started_at=started_at, local_mlx=True,
                          config={**flags_of(args), "rows": rows, "device": result.pop("device")},
                          results=result, ratios=lane_over_ring(result["shapes"]))
    emit(report, args, format_hop(report))
    return 0


def lane_over_ring(shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each shape's round trip over the TCP lane over its round trip over the ring (> 1: the lane is slower)."""
    return [{"rows": s["rows"], "compares": "lane / ring round trip",
             "value": round(s["lane_ms_p50"] / s["ring_ms_p50"], 3) if s["ring_ms_p50"] else None} for s in shapes]


def format_hop(report: dict[str, Any]) -> str:
    """One row per payload shape, the median of every part in ms (pure)."""
    parts = ("ring", "lane", "compute", "sync", "to_host", "from_host")
    header = f"{'rows':>6} {'bytes':>10} " + " ".join(f"{p + ' ms':>12}" for p in parts)
    lines = [f"{report['config']['device']}, {report['results']['dtype']}, hidden {report['results']['hidden']}",
             header]
    for shape in report["results"]["shapes"]:
        lines.append(f"{shape['rows']:>6} {shape['bytes']:>10} "
                     + " ".join(f"{shape[f'{p}_ms_p50']:>12.4f}" for p in parts))
    return "\n".join(lines)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)


def _rank_main(config: dict[str, Any]) -> None:
    """One rank of the hop (``MLX_RANK``), run as ``python -m stagemesh.bench.hop CONFIG``; rank 0 writes the
    result. ``ring``: evaluate the array, hand it to MLX's ring, receive, evaluate; ``lane``: evaluate, copy
    to host, ``sendall``; ``recv_into`` a buffer, ``mx.array`` on the device."""
    import mlx.core as mx

    # The lane arm moves bytes exactly as a stage's OutboundLink / InboundLink do.
    from stage_worker.transport.links import recv_exactly_into
    from stage_worker.transport.wire import FrameHeader, FrameKind, payload_bytes, payload_from_bytes

    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    dtype = getattr(mx, config["dtype"])
    lane = _lane(rank, config["lane_port"])
    hidden, iters, warmup = config["hidden"], config["iters"], config["warmup"]
    results: dict[str, Any] = {"device": str(mx.default_device()), "dtype": config["dtype"], "hidden": hidden,
                               "mlx": getattr(mx, "__version__", "unknown"), "shapes": []}
    weight = mx.random.normal((hidden, hidden)).astype(dtype) * 0.01
    for rows in config["rows"]:
        x = mx.random.normal((rows, hidden)).astype(dtype)
        mx.eval(x, weight)
        nbytes = rows * hidden * x.itemsize
        buffer = bytearray(nbytes)
        header = FrameHeader(FrameKind.FORWARD, 0, 0, 1, rows, hidden, dtype)
        timings: dict[str, list[float]] = {"ring": [], "lane": [], "compute": [], "sync": [], "to_host": [],
                                           "from_host": []}
        for i in range(warmup + iters):
            record = i >= warmup
            # ring: rank 0 computes, sends; rank 1 receives, computes, sends back.
            started = time.perf_counter()
            if rank == 0:
                y = x @ weight
                mx.eval(mx.distributed.send(y, 1, group=group))
                back = mx.distributed.recv((rows, hidden), dtype, 1, group=group)
                mx.eval(back)
            else:
                got = mx.distributed.recv((rows, hidden), dtype, 0, group=group)
                mx.eval(mx.distributed.send(got @ weight, 0, group=group))
            if record and rank == 0:
                timings["ring"].append(time.perf_counter() - started)
            # lane: the same through the TCP socket, bytes copied through host memory.
            started = time.perf_counter()
            if rank == 0:
                lane.sendall(payload_bytes(x @ weight))
                recv_exactly_into(lane, buffer, "the other rank")
                mx.eval(payload_from_bytes(buffer, header))
            else:
                recv_exactly_into(lane, buffer, "the other rank")
                lane.sendall(payload_bytes(payload_from_bytes(buffer, header) @ weight))
            if record and rank == 0:
                timings["lane"].append(time.perf_counter() - started)
            if rank == 0:
                started = time.perf_counter()
                mx.eval(x @ weight)
                if record:
                    timings["compute"].append(time.perf_counter() - started)
                started = time.perf_counter()
                mx.eval(x + 1)
                sync_done = time.perf_counter()
                host = payload_bytes(y)
                copied = time.perf_counter()
                mx.eval(payload_from_bytes(host, header))
                if record:
                    timings["sync"].append(sync_done - started)
                    timings["to_host"].append(copied - sync_done)
                    timings["from_host"].append(time.perf_counter() - copied)
        if rank == 0:
            results["shapes"].append({"rows": rows, "bytes": nbytes,
                                      **{f"{k}_ms_p50": _median_ms(v) for k, v in timings.items()}})
    if rank == 0:
        Path(config["result"]).write_text(json.dumps(results))
    lane.close()


def _lane(rank: int, port: int) -> socket.socket:
    if rank == 1:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        sock, _ = listener.accept()
        listener.close()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock



if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
