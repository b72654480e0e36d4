"""The verdict of ``stagemesh bench compare --comparisons prefix``: the prefix cache's ratios from two reports. Pure.

Contract: ``summarize(multi_turn_doc, distinct_doc, counters=..., baseline=, cached=, reference=)`` reads two
``stagemesh bench serve`` reports (``--output``; the multi-turn and the distinct-prompt workload over the same
three endpoints) and returns JSON-ready data: ``multi_turn`` / ``distinct`` (per endpoint and level, TTFT p50
of all turns, turn by turn and of turns 2 and later, output tok/s, completed/sent); ``targets``, the three the
prefix cache is held to (``TTFT_ON_OVER_OFF``, ``TTFT_ON_OVER_REFERENCE``, ``DISTINCT_TOK_S_ON_OVER_OFF``),
each with its value, the bound and whether it is met (None when a figure is missing); and
``prefix_cache_counters``, what the caller read from each stagemesh server's ``/metrics``, as given.
Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

from stagemesh.bench.stats import percentile

TTFT_ON_OVER_OFF = 0.4
TTFT_ON_OVER_REFERENCE = 1.0
DISTINCT_TOK_S_ON_OVER_OFF = 0.97


def _later_turns_ttft_p50(doc: dict[str, Any], endpoint: str, level: str) -> float | None:
    values = [r["ttft"] for r in doc["results"]["requests"] if r["endpoint"] == endpoint and r["level"] == level
              and r["ok"] and r.get("turn", 0) >= 2 and r["ttft"] is not None]
    return percentile(values, 50)


def _figures(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per "endpoint level": the figures the verdict reads."""
    out = {}
    for m in doc["results"]["levels"]:
        out[f"{m['endpoint']} {m['level']}"] = {
            "endpoint": m["endpoint"], "level": m["level"],
            "completed": m["completed"], "sent": m["sent"],
            "ttft_p50_s": m["ttft"]["p50"],
            "ttft_p50_by_turn_s": [d["p50"] for d in m.get("ttft_by_turn") or []],
            "ttft_p50_later_turns_s": _later_turns_ttft_p50(doc, m["endpoint"], m["level"]),
            "output_tokens_per_s": m["output_tokens_per_s"],
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _target(name: str, value: float | None, bound: float, at_most: bool) -> dict[str, Any]:
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return {"name": name, "value": value, "target": f"{'<=' if at_most else '>='} {bound:g}", "met": met}


def summarize(multi_turn_doc: dict[str, Any], distinct_doc: dict[str, Any], *, counters: dict[str, Any],
              baseline: str, cached: str, reference: str) -> dict[str, Any]:
    """The verdict (see the module docstring). The targets, all at the first level of each document:
    multi-turn TTFT p50 of ``cached`` over ``baseline`` (at most ``TTFT_ON_OVER_OFF``), of ``cached`` over
    ``reference`` (at most ``TTFT_ON_OVER_REFERENCE``: no worse than mlx_lm.server), and distinct-prompt
    output tok/s of ``cached`` over ``baseline`` (at least ``DISTINCT_TOK_S_ON_OVER_OFF``)."""
    multi, distinct = _figures(multi_turn_doc), _figures(distinct_doc)

    def at(figures: dict[str, dict[str, Any]], doc: dict[str, Any], endpoint: str, key: str) -> float | None:
        level = doc["config"]["levels"][0]
        entry = figures.get(f"{endpoint} {level}")
        return None if entry is None else entry[key]

    ttft_on = at(multi, multi_turn_doc, cached, "ttft_p50_s")
    targets = [
        _target(f"multi-turn TTFT p50, {cached} / {baseline}",
                _ratio(ttft_on, at(multi, multi_turn_doc, baseline, "ttft_p50_s")), TTFT_ON_OVER_OFF, True),
        _target(f"multi-turn TTFT p50, {cached} / {reference}",
                _ratio(ttft_on, at(multi, multi_turn_doc, reference, "ttft_p50_s")), TTFT_ON_OVER_REFERENCE, True),
        _target(f"distinct prompts output tok/s, {cached} / {baseline}",
                _ratio(at(distinct, distinct_doc, cached, "output_tokens_per_s"),
                       at(distinct, distinct_doc, baseline, "output_tokens_per_s")),
                DISTINCT_TOK_S_ON_OVER_OFF, False),
    ]
    return {"targets": targets, "multi_turn": multi, "distinct": distinct, "prefix_cache_counters": counters,
            "workloads": {"multi_turn": multi_turn_doc["config"]["workload_summary"],
                          "distinct": distinct_doc["config"]["workload_summary"]},
            "environment": multi_turn_doc["environment"]}
