"""``stagemesh status --watch``: the dashboard's live figures in a terminal, redrawn in place.

For a Mac reached over SSH: the same document the web page polls (``GET /dashboard/live``, docs/api.md "Live
mesh data (dashboard)") drawn with rich every ``--interval`` seconds: the model and overall figures (output
tokens/s, TTFT and inter-token percentiles over the last minute, requests in flight, errors), one table per
replica (titled with what the coordinator is doing about it while it does not serve) with a row per stage,
and the latest events with their times.

Contract: ``render(doc)`` is pure (a rich renderable from the JSON); ``watch(...)`` loops until Ctrl-C or
``count`` redraws and returns the exit code: 0 when the last view had a healthy replica, 1 when none, 2 when
the gateway could not be read (401 names ``--api-key``).
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

EVENTS_SHOWN = 8


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def _percentiles(summary: dict[str, Any] | None) -> str:
    if not summary or not summary.get("count"):
        return "-"
    return f"p50 {_ms(summary['p50'])} p90 {_ms(summary['p90'])} p99 {_ms(summary['p99'])}"


def _clock(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix).strftime("%H:%M:%S")


def _supervision(replica: dict[str, Any], now: float) -> str:
    """"backing off: restart 4 in 16s  " while the coordinator waits before restarting it; "" while it serves."""
    state = replica.get("state")
    if state in (None, "serving"):
        return ""
    text = escape(state.replace("_", " "))
    if state == "backing_off" and replica.get("next_restart_at") is not None:
        text += f": restart {replica['restarts'] + 1} in {_duration(max(0.0, replica['next_restart_at'] - now))}"
    return f"[yellow]{text}[/]  "


def _replica_table(replica: dict[str, Any], now: float) -> Table:
    """One replica: a title with its figures and what the coordinator is doing about it (restarting, or backing
    off until its next restart), and a row per stage (host, layers, dtype, state, health, pid, uptime, running /
    waiting, batches/s, compute / wait / send shares, KV use)."""
    state = "[green]healthy[/]" if replica["healthy"] else "[bold red]UNHEALTHY[/]"
    title = (f"replica {replica['replica']}  {state}  {_num(replica['output_tokens_per_s'])} tok/s  "
             f"{replica['in_flight']} in flight  {replica['restarts']} restart(s)  {_supervision(replica, now)}"
             f"TTFT {_percentiles(replica.get('ttft_s'))}  ITL {_percentiles(replica.get('itl_s'))}  "
             f"{replica.get('recent_failures') or 0} failed in the last minute")
    table = Table(title=title, title_justify="left", expand=False)
    for column in ("stage", "host", "layers", "dtype", "state", "health", "pid", "uptime", "run/wait", "batch/s",
                   "compute/wait/send", "KV"):
        table.add_column(column)
    for stage in replica["stages"]:
        rates, stats = stage.get("rates"), stage["stats"]
        shares = "/".join(_pct(rates[k]) for k in ("compute_share", "wait_share", "send_share")) if rates else "-"
        start, end = stage["layers"]
        table.add_row(  # values from the mesh are escaped: a "[" in them is text, not rich markup
            str(stage["rank"]), escape(stage["host"]), escape(f"[{start}, {end})"),
            escape(f"{stage['compute_dtype']}{' q' if stage['quantized'] else ''}"), escape(stage["state"]),
            "[green]yes[/]" if stage["healthy"] else "[bold red]NO[/]", str(stage["pid"] or "-"),
            _duration(stage.get("uptime_s")), f"{stats['running_sequences']}/{stats['waiting_requests']}",
            _num(rates["batches_per_s"]) if rates else "-", shares, _pct(stage.get("kv_use")),
        )
    return table


def render(doc: dict[str, Any]) -> RenderableType:
    """The live document as rich tables (pure)."""
    o = doc["overall"]
    recent = o.get("recent") or {}
    errors = recent.get("client_errors", 0) + recent.get("server_errors", 0)
    head = Text.from_markup(
        f"[bold]{escape(doc['model'])}[/] ({doc['num_layers']} layers)  {o['healthy_replicas']}/{len(doc['replicas'])} "
        f"replicas healthy  updated {_clock(doc['time'])}\n"
        f"output {_num(o['output_tokens_per_s'])} tok/s   TTFT {_percentiles(o.get('ttft_s'))}   "
        f"ITL {_percentiles(o.get('itl_s'))}   in flight {o['requests_running']}   "
        f"errors {errors} in the last minute ({o['server_errors_total'] + o['client_errors_total']} since start)")
    parts: list[RenderableType] = [head, *(_replica_table(r, doc["time"]) for r in doc["replicas"])]
    events = doc.get("events", [])[-EVENTS_SHOWN:]
    if events:
        lines = Text("events (newest last):\n", style="bold")
        for event in events:
            lines.append(f"  {_clock(event['time'])}  {event['kind']:<19} {event['message']}\n")
        parts.append(lines)
    return Group(*parts)


def _fetch(url: str, api_key: str | None, timeout: float) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url, headers=headers, timeout=timeout)
    if response.status_code == 401:
        raise PermissionError(f"{url} needs the gateway's API key: pass --api-key (or set STAGEMESH_API_KEY)")
    response.raise_for_status()
    return response.json()


def watch(base_url: str, api_key: str | None, interval: float, count: int | None, timeout: float) -> int:
    import httpx
    from rich.live import Live

    url = base_url.rstrip("/") + "/dashboard/live"
    console = Console()
    healthy = False
    shown = 0
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            try:
                doc = _fetch(url, api_key, timeout)
            except (httpx.HTTPError, PermissionError) as exc:
                live.stop()
                print(f"stagemesh status: cannot read {url}: {exc}", file=sys.stderr)
                return 2
            healthy = doc["overall"]["healthy_replicas"] > 0
            live.update(render(doc), refresh=True)
            shown += 1
            if count is not None and shown >= count:
                break
            time.sleep(interval)
    return 0 if healthy else 1
