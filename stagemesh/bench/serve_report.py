"""The results and the text of ``stagemesh bench serve``, inside the report every kind shares.

Contract:
- ``serve_results(...)`` is the kind's ``results`` (``stagemesh.bench.report``
  wraps it): ``endpoints``, ``summary`` (sent, completed, failed,
  warmup_failed), ``levels`` (every round of an (endpoint, level) pooled),
  ``rounds`` (each round alone), ``warmup`` and ``requests`` (every raw
  record). Times are seconds.
- ``format_report(report)`` renders a whole report as text for stdout: the
  metrics table (latencies in ms), then failures (every distinct error with
  its HTTP status and count), for the multi-turn workload the TTFT p50 of
  every turn, and, with several endpoints, the ratios to the first. It reads
  only the report, so a saved ``results.json`` renders the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from stagemesh.bench.stats import LevelMetrics
from stagemesh.bench.types import Endpoint, Level, RequestRecord


def _level_entry(m: LevelMetrics, level: Level, **extra: Any) -> dict[str, Any]:
    # "inf" as a string: JSON has no infinity, and jq rejects Python's Infinity.
    value = level.value if math.isfinite(level.value) else "inf"
    return {**extra, "load": level.kind, "load_value": value, **m.to_dict()}


def serve_results(*, endpoints: Sequence[Endpoint], levels: Sequence[Level], pooled: Sequence[LevelMetrics],
                  per_round: Sequence[tuple[int, LevelMetrics]], warmup: Sequence[LevelMetrics],
                  records: Sequence[RequestRecord]) -> dict[str, Any]:
    level_of = {lv.name: lv for lv in levels}
    return {
        "endpoints": [{"label": e.label, "base_url": e.base_url, "model": e.model} for e in endpoints],
        "summary": {
            "sent": len(records),
            "completed": sum(1 for r in records if r.ok),
            "failed": sum(1 for r in records if not r.ok),
            "warmup_failed": sum(m.failed for m in warmup),
        },
        "levels": [_level_entry(m, level_of[m.level]) for m in pooled],
        "rounds": [_level_entry(m, level_of[m.level], round=r) for r, m in per_round],
        "warmup": [m.to_dict() for m in warmup],
        "requests": [asdict(r) for r in records],
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _table(rows: Sequence[tuple[str, ...]], right_from: int = 1) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i < right_from else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def format_table(levels: Sequence[dict[str, Any]]) -> list[str]:
    header = ("endpoint", "level", "ok", "failed", "req/s", "out tok/s", "total tok/s",
              "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "E2E p50")
    units = ("", "", "", "", "", "", "", "ms", "ms", "ms", "ms", "ms", "ms")
    rows = [header, units]
    for m in levels:
        rows.append((
            m["endpoint"], m["level"], f"{m['completed']}/{m['sent']}",
            str(m["failed"]) if not m["failed"] else f"{m['failed']} !",
            _num(m["requests_per_s"], 2), _num(m["output_tokens_per_s"]), _num(m["total_tokens_per_s"]),
            _ms(m["ttft"]["p50"]), _ms(m["ttft"]["p99"]), _ms(m["itl"]["p50"]), _ms(m["itl"]["p99"]),
            _ms(m["tpot"]["p50"]), _ms(m["e2el"]["p50"]),
        ))
    return _table(rows, right_from=2)


def format_turns(results: dict[str, Any]) -> list[str]:
    """TTFT p50 (ms) of every turn of the multi-turn workload; nothing for the synthetic one."""
    levels = [m for m in results["levels"] if m.get("ttft_by_turn")]
    if not levels:
        return []
    turns = max(len(m["ttft_by_turn"]) for m in levels)
    rows = [("endpoint", "level", *(f"turn {t}" for t in range(1, turns + 1)))]
    for m in levels:
        cells = [_ms(d["p50"]) for d in m["ttft_by_turn"]]
        rows.append((m["endpoint"], m["level"], *cells, *("-" for _ in range(turns - len(cells)))))
    return ["TTFT p50 by turn (ms; turn 1 shares only the system prompt, later turns their history)",
            *_table(rows, right_from=2)]


def format_failures(results: dict[str, Any]) -> list[str]:
    lines = []
    summary = results["summary"]
    if summary["failed"]:
        lines.append(f"FAILED: {summary['failed']} of {summary['sent']} requests")
        for m in results["levels"]:
            if m["failed"]:
                lines.append(f"  {m['endpoint']} {m['level']}: {m['failed']} of {m['sent']} failed")
                lines += _error_lines(m["errors"])
    for m in results["warmup"]:
        if m["failed"]:
            lines.append(f"WARMUP FAILED: {m['endpoint']}: {m['failed']} of {m['sent']} warmup requests")
            lines += _error_lines(m["errors"])
    return lines


def _error_lines(errors: list[dict[str, Any]]) -> list[str]:
    return [f"    {e['count']} x {'HTTP ' + str(e['status']) if e['status'] is not None else 'no response'}: "
            f"{e['message']}" for e in errors]


def format_ratios(ratios: list[dict[str, Any]]) -> list[str]:
    if not ratios:
        return []
    base = ratios[0]["baseline"]
    rounds = max(len(r["output_tokens_per_s_by_round"]) for r in ratios)
    turns = any(r.get("ttft_p50_by_turn") for r in ratios)
    header = ("level", "endpoint", "out tok/s", "TTFT p50", "ITL p50") + (("tok/s by round",) if rounds > 1 else ()) \
        + (("TTFT p50 by turn",) if turns else ())
    rows = [header]
    for r in ratios:
        row: tuple[str, ...] = (r["level"], r["endpoint"], _x(r["output_tokens_per_s"]), _x(r["ttft_p50"]),
                                _x(r["itl_p50"]))
        if rounds > 1:
            row += (" ".join(_x(x) for x in r["output_tokens_per_s_by_round"]),)
        if turns:
            row += (" ".join(_x(x) for x in r.get("ttft_p50_by_turn") or ()),)
        rows.append(row)
    return [f"ratios to {base} (out tok/s > 1: faster; TTFT/ITL > 1: slower)", *_table(rows, right_from=2)]


def format_report(report: dict[str, Any]) -> str:
    results = report["results"]
    lines = format_table(results["levels"])
    for section in (format_turns(results), format_failures(results), format_ratios(report["ratios"])):
        if section:
            lines += ["", *section]
    s = results["summary"]
    lines += ["", f"{s['completed']}/{s['sent']} requests completed, {s['failed']} failed"]
    return "\n".join(lines)
