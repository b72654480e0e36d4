"""Where a stagemesh server's time goes under load, stage by stage.

``profile_endpoint`` loads one stagemesh endpoint alone with one ``stagemesh bench serve`` level, and reads
the stages' cumulative counters from the gateway's ``/metrics`` before and after it (``parse_stage_counters``:
``stagemesh_stage_{compute,wait,send}_seconds_total`` and ``stagemesh_stage_{batches,tokens}_total``), and the
CPU time of the ``stagemesh serve`` process (gateway, coordinator and Ray driver) over the same span
(``process_cpu_seconds``). The pure ``stage_profiles`` turns the two snapshots and the level's wall time into
one ``StageProfile`` per stage (compute, ring wait, send, other); ``format_profile`` shows them as shares of
the wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from stagemesh_core.snapshots import StageStats

_COUNTERS = {
    "stagemesh_stage_compute_seconds_total": "compute_seconds",
    "stagemesh_stage_wait_seconds_total": "wait_seconds",
    "stagemesh_stage_send_seconds_total": "send_seconds",
    "stagemesh_stage_batches_total": "batches",
    "stagemesh_stage_tokens_total": "tokens",
}

StageKey = tuple[int, int]  # (replica, rank)


@dataclass(frozen=True)
class StageProfile:
    """One stage's time over a span:

    - **compute**: the stage's own layers (and embedding / head / sampling) on its batches;
    - **ring wait**: blocked on its inbound link (a relay stage waiting for work, or the entry stage waiting
      for the sampled tokens of a batch it sent);
    - **send**: handing results to the next stage;
    - **other**: the rest of the wall time. On the entry stage this is scheduling, delivering tokens to the
      gRPC streams and waiting for new requests; on a relay it is only bookkeeping, since its idle time is
      ring wait."""

    replica: int
    rank: int
    wall_s: float
    compute_s: float
    wait_s: float
    send_s: float
    batches: int
    tokens: int

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s - self.wait_s - self.send_s)

    @property
    def rows_per_batch(self) -> float:
        return self.tokens / self.batches if self.batches else 0.0


def parse_stage_counters(metrics_text: str) -> dict[StageKey, StageStats]:
    """The stage counters in a Prometheus text exposition, by (replica, rank)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[StageKey, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            field = _COUNTERS.get(sample.name)
            if field is None:
                continue
            if sample.labels.get("worker", "0") != "0":  # a tensor-parallel member computes its worker 0's batches
                continue
            key = (int(sample.labels.get("replica", 0)), int(sample.labels.get("rank", 0)))
            values.setdefault(key, {})[field] = sample.value
    return {key: _stage_stats(fields) for key, fields in values.items()}


def _stage_stats(fields: Mapping[str, float]) -> StageStats:
    """The counters read for one stage; Prometheus gives every sample as a float, the counts are whole."""
    return StageStats(
        compute_seconds=fields.get("compute_seconds", 0.0), wait_seconds=fields.get("wait_seconds", 0.0),
        send_seconds=fields.get("send_seconds", 0.0), batches=int(fields.get("batches", 0)),
        tokens=int(fields.get("tokens", 0)),
    )


def stage_profiles(before: Mapping[StageKey, StageStats], after: Mapping[StageKey, StageStats],
                   wall_s: float) -> list[StageProfile]:
    """Per-stage time over a span of ``wall_s`` seconds between two counter snapshots (pure)."""
    rows = []
    for key in sorted(after):
        a, b = after[key], before.get(key, StageStats())
        compute, send = a.compute_seconds - b.compute_seconds, a.send_seconds - b.send_seconds
        # A relay counts its wait when a message arrives, so the level's first message also brings
        # the idle time before the level; within the span it cannot exceed what is left of the wall.
        wait = min(a.wait_seconds - b.wait_seconds, max(0.0, wall_s - compute - send))
        rows.append(StageProfile(key[0], key[1], wall_s, compute, wait, send, int(a.batches - b.batches),
                                 int(a.tokens - b.tokens)))
    return rows


def format_profile(label: str, rows: Sequence[StageProfile], gateway_cpu_s: float | None,
                   output_tokens: int = 0) -> list[str]:
    """A table of the rows as shares of the wall time, and the gateway process's CPU (per output token
    when ``output_tokens`` is known)."""
    if not rows:
        return [f"{label}: no stage counters on /metrics"]
    wall = rows[0].wall_s
    lines = [f"{label}: where the time went over {wall:.1f} s at one load level (share of wall time)",
             f"  {'stage':<10} {'compute':>8} {'ring wait':>10} {'send':>6} {'other':>7} {'batches':>8} "
             f"{'rows/batch':>11} {'ms/batch':>9}"]
    for r in rows:
        per_batch = 1000 * r.compute_s / r.batches if r.batches else 0.0
        lines.append(f"  r{r.replica}/s{r.rank:<7} {_share(r.compute_s, wall):>8} {_share(r.wait_s, wall):>10} "
                     f"{_share(r.send_s, wall):>6} {_share(r.other_s, wall):>7} {r.batches:>8} "
                     f"{r.rows_per_batch:>11.1f} {per_batch:>9.1f}")
    if gateway_cpu_s is not None:
        per_token = f", {1000 * gateway_cpu_s / output_tokens:.2f} CPU ms per output token" if output_tokens else ""
        lines.append(f"  gateway process (gateway + coordinator + Ray driver): {gateway_cpu_s:.1f} CPU s "
                     f"= {100 * gateway_cpu_s / wall:.0f}% of one core{per_token}")
    return lines


def _share(seconds: float, wall: float) -> str:
    return f"{100 * seconds / wall:.0f}%" if wall > 0 else "-"


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (its threads, not its children), on Linux and macOS;
    None when it is gone or not ours to read."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return times.user + times.system


def profile_endpoint(url: str, label: str, model: str, serve_pid: int, *, concurrency: int, num_prompts: int,
                     input_len: int, output_len: int, tokenizer_dir: str) -> dict:
    """Load one stagemesh endpoint alone for one level and return the profile (rows and gateway CPU)."""
    import httpx

    def counters() -> dict[StageKey, StageStats]:
        time.sleep(1.5)  # the gateway refreshes stage counters every second
        return parse_stage_counters(httpx.get(f"{url}/metrics", timeout=10).text)

    with tempfile.TemporaryDirectory(prefix="stagemesh-profile-") as tmp:
        result = os.path.join(tmp, "level.json")
        before, cpu_before = counters(), process_cpu_seconds(serve_pid)
        subprocess.run([sys.executable, "-m", "stagemesh.cli", "bench", "serve", "--base-url", url, "--label", label,
                        "--model", model, "--concurrency", str(concurrency), "--num-prompts", str(num_prompts),
                        "--input-len", str(input_len), "--output-len", str(output_len), "--warmup", "0",
                        "--tokenizer", tokenizer_dir, "--output", result], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after, cpu_after = counters(), process_cpu_seconds(serve_pid)
        level = json.load(open(result))["results"]["levels"][0]
    rows = stage_profiles(before, after, float(level["wall_time"]))
    gateway = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    output_tokens = round(float(level["output_tokens_per_s"]) * float(level["wall_time"]))
    for line in format_profile(f"{label} at concurrency {concurrency}", rows, gateway, output_tokens):
        print(line, file=sys.stderr)
    return {"label": label, "concurrency": concurrency, "wall_s": float(level["wall_time"]),
            "output_tokens_per_s": level["output_tokens_per_s"], "gateway_cpu_s": gateway,
            "output_tokens": output_tokens,
            "gateway_cpu_ms_per_output_token": 1000 * gateway / output_tokens if gateway and output_tokens else None,
            "stages": [{**asdict(r), "other_s": r.other_s} for r in rows]}
