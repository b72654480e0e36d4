"""The soak's verdict, pure: records in, figures and pass/fail out.

Inputs are plain values the soak gathered: every request (``RequestRecord``), every fault (``FaultRecord``,
with when the faulted replica was whole again), and each process's resources at start and end
(``ProcessSample``). ``judge(...)`` returns a ``SoakReport`` (``passed``, ``to_json``); ``format_report``
prints it. The run fails on any hung request, any failure outside a fault's window, a recovery slower than
``max_recovery_s`` or never reached, or resources that grew beyond ``flat_within``.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    kind: str  # "stream", "abandon" (client leaves mid-stream), "bad" (invalid input: must be a 4xx)
    started: float  # seconds since the soak began
    ended: float
    outcome: str  # "ok", "abandoned", "rejected" (a bad input's 4xx), "failed", "hung"
    status: int | None = None
    error: str = ""
    tokens: int = 0


@dataclass(frozen=True)
class FaultRecord:
    kind: str  # "kill" (SIGKILL), "stop" (SIGSTOP then SIGCONT), "block" (the stage's ports dropped)
    replica: int
    rank: int
    pid: int
    injected: float
    ended: float | None  # when the fault itself ended (SIGCONT sent, ports unblocked); kill: the injection
    recovered: float | None  # when every stage of the replica served again; None: never

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.injected


@dataclass(frozen=True)
class ProcessSample:
    name: str  # "gateway", "replica 0 stage 1"
    pid: int
    rss_bytes: int
    open_fds: int


@dataclass
class SoakReport:
    config: dict[str, Any]
    duration_s: float
    requests: dict[str, int]
    failures_by_error: dict[str, int]  # "503 no_healthy_replica": 12, "mid-stream pipeline_failed": 3, ...
    failures_excused: list[dict[str, Any]]
    failures_unexcused: list[dict[str, Any]]
    hung: int
    hung_requests: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    recovery_median_s: float | None
    recovery_worst_s: float | None
    resources: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def _in_window(record: RequestRecord, faults: Sequence[FaultRecord], end_of_run: float) -> bool:
    return any(record.started <= (f.recovered if f.recovered is not None else end_of_run)
               and record.ended >= f.injected for f in faults)


def _error_class(record: RequestRecord) -> str:
    """A failure's kind in a few words: the HTTP status and OpenAI code, or that it broke mid-stream."""
    if record.status == 200:
        return "broke mid-stream"
    if record.status is None:
        return "connection error" if record.error else "no answer"
    try:
        code = json.loads(record.error)["error"]["code"] or ""
    except (ValueError, KeyError, TypeError):
        code = ""
    return f"{record.status} {code}".strip()


def judge(config: dict[str, Any], duration_s: float, records: Sequence[RequestRecord],
          faults: Sequence[FaultRecord], start: Sequence[ProcessSample], end: Sequence[ProcessSample], *,
          max_recovery_s: float = 60.0, flat_within: float = 0.10) -> SoakReport:
    """The verdict on one soak run.

    - A request is *hung* when it was silent (no byte) for the soak's stall limit or outlived its deadline:
      never allowed.
    - A failed request is *excused* only when it was in flight during a fault's window (injection to
      recovery) and carries a clear error message; any other failure counts against the run. (The gateway
      does not say which replica served a request, so with DP > 1 a failure on the healthy replica during a
      fault's window is excused too: the report is an upper bound on what the faults cost.)
    - Recovery: seconds from injection until every stage of the replica served again; the worst must stay
      under ``max_recovery_s``; a fault never recovered fails the run.
    - Resources: the gateway's resident memory and open descriptors at the end within ``flat_within`` of the
      start, and likewise for each stage process that ran from start to end (a restarted stage is a new
      process: its figures are reported, not judged).
    """
    outcomes = Counter(r.outcome for r in records)
    counts = {"total": len(records), **{k: outcomes.get(k, 0) for k in ("ok", "abandoned", "rejected", "failed",
                                                                         "hung")},
              "tokens": sum(r.tokens for r in records)}
    excused: list[dict[str, Any]] = []
    unexcused: list[dict[str, Any]] = []
    for r in records:
        if r.outcome != "failed":
            continue
        entry = {"kind": r.kind, "at_s": round(r.started, 1), "status": r.status, "error": r.error[:300]}
        (excused if r.error and _in_window(r, faults, duration_s) else unexcused).append(entry)
    by_error = Counter(_error_class(r) for r in records if r.outcome == "failed")
    recoveries = [f.recovery_s for f in faults if f.recovery_s is not None]
    problems = []
    if counts["hung"]:
        problems.append(f"{counts['hung']} request(s) hung past the per-request deadline")
    if unexcused:
        problems.append(f"{len(unexcused)} request(s) failed outside any fault's window or without a clear error")
    if not counts["ok"]:
        problems.append("no request was served")
    never = [f for f in faults if f.recovered is None]
    if never:
        problems.append(f"{len(never)} fault(s) never recovered: " + ", ".join(
            f"{f.kind} replica {f.replica} stage {f.rank} at {f.injected:.0f} s" for f in never))
    if recoveries and max(recoveries) > max_recovery_s:
        problems.append(f"worst recovery {max(recoveries):.1f} s exceeds {max_recovery_s:.0f} s")
    resources = []
    before = {s.name: s for s in start}
    for after in end:
        first = before.get(after.name)
        row: dict[str, Any] = {"name": after.name, "pid_end": after.pid,
                               "rss_end_mb": round(after.rss_bytes / 2**20, 1), "fds_end": after.open_fds}
        if first is not None:
            row.update(pid_start=first.pid, rss_start_mb=round(first.rss_bytes / 2**20, 1), fds_start=first.open_fds,
                       same_process=first.pid == after.pid)
            if first.pid == after.pid:
                grew = [what for what, a, b in (("memory", first.rss_bytes, after.rss_bytes),
                                                 ("descriptors", first.open_fds, after.open_fds))
                        if b > a * (1 + flat_within) and b - a > (4 if what == "descriptors" else 0)]
                if grew:
                    problems.append(f"{after.name}: {' and '.join(grew)} grew more than {flat_within:.0%} "
                                    f"(rss {first.rss_bytes / 2**20:.0f} -> {after.rss_bytes / 2**20:.0f} MB, "
                                    f"fds {first.open_fds} -> {after.open_fds})")
        resources.append(row)
    return SoakReport(
        config=config, duration_s=round(duration_s, 1), requests=counts, failures_by_error=dict(by_error.most_common()),
        failures_excused=excused,
        failures_unexcused=unexcused, hung=counts["hung"],
        hung_requests=[{"kind": r.kind, "at_s": round(r.started, 1), "error": r.error} for r in records
                       if r.outcome == "hung"],
        faults=[{**asdict(f), "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 1)} for f in faults],
        recovery_median_s=round(statistics.median(recoveries), 1) if recoveries else None,
        recovery_worst_s=round(max(recoveries), 1) if recoveries else None,
        resources=resources, problems=problems,
    )


def format_report(report: SoakReport) -> str:
    c, r = report.config, report.requests
    lines = [f"stagemesh soak: -pp {c.get('pp')} -dp {c.get('dp')}, {c.get('streams')} streams, "
             f"{report.duration_s:.0f} s, faults {', '.join(c.get('faults', [])) or 'none'}",
             f"  requests: {r['total']} ({r['ok']} served, {r['abandoned']} abandoned by the client, "
             f"{r['rejected']} bad inputs rejected with 4xx, {r['failed']} failed, {r['hung']} hung); "
             f"{r['tokens']} tokens",
             f"  failures: {len(report.failures_excused)} in flight during a fault (excused), "
             f"{len(report.failures_unexcused)} elsewhere; by kind: "
             + (", ".join(f"{k} x{n}" for k, n in report.failures_by_error.items()) or "none")]
    for hung in report.hung_requests[:5]:
        lines.append(f"    hung: {hung['kind']} started at {hung['at_s']:.1f} s: {hung['error']}")
    for failure in report.failures_excused[:5] + report.failures_unexcused[:5]:
        lines.append(f"    {failure['at_s']:>7.1f} s  {failure['status']}  {failure['error'][:140]}")
    for fault in report.faults:
        rec = f"recovered in {fault['recovery_s']:.1f} s" if fault["recovery_s"] is not None else "NEVER recovered"
        lines.append(f"  fault {fault['kind']:<5} replica {fault['replica']} stage {fault['rank']} at "
                     f"{fault['injected']:.0f} s: {rec}")
    if report.recovery_worst_s is not None:
        lines.append(f"  recovery: median {report.recovery_median_s:.1f} s, worst {report.recovery_worst_s:.1f} s")
    for row in report.resources:
        if "rss_start_mb" in row:
            same = "" if row["same_process"] else f" (restarted: pid {row['pid_start']} -> {row['pid_end']})"
            lines.append(f"  {row['name']:<20} rss {row['rss_start_mb']:>7.1f} -> {row['rss_end_mb']:>7.1f} MB, "
                         f"fds {row['fds_start']:>4} -> {row['fds_end']:>4}{same}")
    lines.append("PASSED" if report.passed else "FAILED: " + "; ".join(report.problems))
    return "\n".join(lines)
