"""``stagemesh status``: the mesh as the coordinator sees it, from a running gateway's ``/mesh``.

Prints one row per stage (replica, rank, layers, host, gRPC and ring ports,
pid, dtype, quantized, MLX backend and device, state, health, KV tokens used of its capacity, then its
prefix cache: the share of prompt tokens it reused, blocks cached now, blocks evicted), then a line for each
replica that is not serving (restarting, or backing off: when its next restart is due and how many failures in a
row it has had) and one for each replica whose entry stage verified proposals (speculative decoding: the share
of proposed tokens accepted, per position, and tokens per verification) or, with ``--json``, the ``/mesh``
document unchanged.
Exits 0 when at least one replica is healthy, 1 when none is, 2 when the
gateway cannot be reached. ``--watch`` redraws the dashboard's live figures in
place instead (``stagemesh.status_watch``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from stagemesh_core import settings
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print GET /mesh as JSON")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--watch", action="store_true",
                        help="redraw live figures in place (GET /dashboard/live) until Ctrl-C")
    parser.add_argument("--interval", type=float, default=None, help="seconds between redraws with --watch (default 1)")
    parser.add_argument("--count", type=int, default=None, help="with --watch: stop after this many redraws")
    parser.add_argument("--api-key", default=None,
                        help="the gateway's key, needed by --watch when it runs with one (default $STAGEMESH_API_KEY)")


def format_mesh(mesh: dict, now: float | None = None) -> str:
    """The /mesh document as a table (pure); ``now`` (Unix seconds) turns a restart's due time into "in N s"."""
    header = ("replica", "rank", "layers", "host", "grpc", "ring", "pid", "dtype", "quant", "backend", "device",
              "state", "healthy", "KV tokens used/capacity", "prefix_hits", "cached_blocks", "evicted_blocks")
    rows = [header]
    for replica in mesh.get("replicas", []):
        for stage in replica.get("stages", []):
            start, end = stage.get("layers", [0, 0])
            rows.append((
                str(replica.get("replica")),
                # A tensor-parallel group's members: "1.1" is stage 1's worker 1.
                str(stage.get("rank")) + (f".{stage['member']}" if stage.get("member") else ""),
                f"[{start}, {end})", str(stage.get("host")),
                str(stage.get("grpc_port")), str(stage.get("ring_port")), str(stage.get("pid") or "-"),
                str(stage.get("compute_dtype")), "yes" if stage.get("quantized") else "no",
                str(stage.get("backend") or "-"), str(stage.get("device") or "-"),
                _state_cell(stage), "yes" if stage.get("healthy") else "NO",
                _kv_cell(stage.get("stats") or {}),
                *_prefix_cache_cells(stage.get("stats") or {}),
            ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"model: {mesh.get('model')}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [line for replica in mesh.get("replicas", []) if (line := _supervision_line(replica, now))]
    lines += [line for replica in mesh.get("replicas", []) if (line := _speculation_line(replica))]
    healthy = sum(1 for r in mesh.get("replicas", []) if r.get("healthy"))
    lines.append(f"{healthy}/{len(mesh.get('replicas', []))} replicas healthy")
    return "\n".join(lines)


def _supervision_line(replica: dict, now: float | None) -> str:
    """What the coordinator is doing about a replica that is not serving ("" when it serves, or from a gateway
    that predates the field)."""
    state = replica.get("state")
    if state in (None, "serving"):
        return ""
    line = f"replica {replica.get('replica')}: {state.replace('_', ' ')}"
    due = replica.get("next_restart_at")
    if state == "backing_off" and due is not None:
        when = f"in {max(0.0, due - now):.0f} s" if now is not None else f"after a {replica.get('backoff_s'):g} s wait"
        line += f", restart {(replica.get('restarts') or 0) + 1} {when}"
    failures = replica.get("consecutive_failures") or 0
    if failures:
        plural = "s" if failures != 1 else ""
        line += f" ({failures} failure{plural} in a row, {replica.get('restarts') or 0} restarts so far)"
    return line


def _speculation_line(replica: dict) -> str:
    """What speculative decoding achieved on the replica's entry stage ("" when it verified nothing)."""
    for stage in replica.get("stages", []):
        stats = stage.get("stats") or {}
        drafted, drafts = stats.get("spec_decode_num_draft_tokens") or 0, stats.get("spec_decode_num_drafts") or 0
        if not drafted or not drafts:
            continue
        accepted = stats.get("spec_decode_num_accepted_tokens") or 0
        per_position = " ".join(f"{100 * n / drafts:.0f}%" for n in stats.get("spec_decode_num_accepted_tokens_per_pos")
                                or ())
        return (f"replica {replica.get('replica')}: speculative decoding accepted {100 * accepted / drafted:.0f}% of "
                f"{drafted} proposed tokens (by position: {per_position or '-'}), "
                f"{(accepted + drafts) / drafts:.2f} tokens per verification")
    return ""


def _state_cell(stage: dict) -> str:
    """The stage's state; while it loads, how much of its weights it has read ("loading 31% of 10.4 GB")."""
    state = str(stage.get("state", ""))
    stats = stage.get("stats") or {}
    total = stats.get("load_total_bytes") or 0
    if state == "loading" and total:
        done = min(stats.get("load_done_bytes") or 0, total)
        return f"loading {100 * done // total}% of {total / 1e9:.1f} GB"
    return state


def _kv_cell(stats: dict) -> str:
    """``used/capacity`` tokens of KV (``-`` before the stage has sized its cache)."""
    capacity = stats.get("kv_token_capacity") or 0
    return f"{stats.get('kv_tokens') or 0}/{capacity}" if capacity else "-"


def _prefix_cache_cells(stats: dict) -> tuple[str, str, str]:
    """Hit rate (of how many prompt tokens), cached blocks, evicted blocks; "-" from a gateway without them."""
    if "prefix_cache_queries" not in stats:
        return "-", "-", "-"
    queries, hits = stats["prefix_cache_queries"], stats.get("prefix_cache_hits", 0)
    rate = f"{100 * hits / queries:.0f}%/{queries}" if queries else "-"
    return rate, str(stats.get("prefix_cache_blocks", 0)), str(stats.get("prefix_cache_evictions", 0))


def run(args: argparse.Namespace) -> int:
    import httpx  # lazily, as rich below: `stagemesh status --help` needs neither

    if args.watch:
        from stagemesh.status_watch import watch

        interval = 1.0 if args.interval is None else args.interval
        if interval <= 0 or (args.count is not None and args.count < 1):
            raise UserError(f"--interval must be positive and --count at least 1, got {interval} and {args.count}")
        return watch(args.url, args.api_key or settings.API_KEY, interval, args.count, args.timeout)
    if args.interval is not None or args.count is not None:
        raise UserError("--interval and --count go with --watch; add --watch or drop them")

    url = args.url.rstrip("/") + "/mesh"
    try:
        response = httpx.get(url, timeout=args.timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"stagemesh status: cannot read {url}: {exc}. Is `stagemesh serve` running there? "
              f"Pass --url to point at its gateway.", file=sys.stderr)
        return 2
    mesh = response.json()
    print(json.dumps(mesh, indent=2) if args.json else format_mesh(mesh, time.time()))
    return 0 if any(r.get("healthy") for r in mesh.get("replicas", [])) else 1
