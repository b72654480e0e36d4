"""The verdict of ``stagemesh bench compare --comparisons prefix``: the prefix cache's ratios from two reports. Pure.

Contract: ``summarize(multi_turn_doc, distinct_doc, counters=..., baseline=, cached=, reference=)`` reads two
``stagemesh bench serve`` reports (``--output``; the multi-turn and the distinct-prompt workload over the same
three endpoints) and returns JSON-ready data: ``multi_turn`` / ``distinct`` (per endpoint and level, TTFT p50
of all turns, turn by turn and of turns 2 and later, output tok/s, completed/sent); ``targets``, the four the
prefix cache is held to (``LATER_TTFT_ON_OVER_OFF``, ``LATER_TTFT_ON_OVER_REFERENCE``,
``MULTI_TURN_TOK_S_ON_OVER_REFERENCE``, ``DISTINCT_TOK_S_ON_OVER_OFF``), each with its value, the bound and
whether it is met (None when a figure is missing); and
``prefix_cache_counters``, what the caller read from each stagemesh server's ``/metrics``, as given.
Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any

from stagemesh.bench.stats import percentile

# What an agent feels is the time to first token of every turn after the first, which re-sends the history: with
# the cache on at most 0.3x of off, and at most half of mlx_lm.server's (its prompt cache on), without giving up
# output speed to it; on prompts that share nothing the cache may cost its lookup and copies only.
LATER_TTFT_ON_OVER_OFF = 0.3
LATER_TTFT_ON_OVER_REFERENCE = 0.5
MULTI_TURN_TOK_S_ON_OVER_REFERENCE = 1.0
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
    """The verdict (see the module docstring). The targets, all at the first level of each document: the
    TTFT p50 of turns 2 and later of ``cached`` over ``baseline`` (at most ``LATER_TTFT_ON_OVER_OFF``) and over
    ``reference`` (at most ``LATER_TTFT_ON_OVER_REFERENCE``), multi-turn output tok/s of ``cached`` over
    ``reference`` (at least ``MULTI_TURN_TOK_S_ON_OVER_REFERENCE``), and distinct-prompt output tok/s of
    ``cached`` over ``baseline`` (at least ``DISTINCT_TOK_S_ON_OVER_OFF``)."""
    multi, distinct = _figures(multi_turn_doc), _figures(distinct_doc)

    def at(figures: dict[str, dict[str, Any]], doc: dict[str, Any], endpoint: str, key: str) -> float | None:
        level = doc["config"]["levels"][0]
        entry = figures.get(f"{endpoint} {level}")
        return None if entry is None else entry[key]

    later = "ttft_p50_later_turns_s"
    ttft_on = at(multi, multi_turn_doc, cached, later)
    tok_s = "output_tokens_per_s"
    targets = [
        _target(f"later turns' TTFT p50, {cached} / {baseline}",
                _ratio(ttft_on, at(multi, multi_turn_doc, baseline, later)), LATER_TTFT_ON_OVER_OFF, True),
        _target(f"later turns' TTFT p50, {cached} / {reference}",
                _ratio(ttft_on, at(multi, multi_turn_doc, reference, later)), LATER_TTFT_ON_OVER_REFERENCE, True),
        _target(f"multi-turn output tok/s, {cached} / {reference}",
                _ratio(at(multi, multi_turn_doc, cached, tok_s), at(multi, multi_turn_doc, reference, tok_s)),
                MULTI_TURN_TOK_S_ON_OVER_REFERENCE, False),
        _target(f"distinct prompts output tok/s, {cached} / {baseline}",
                _ratio(at(distinct, distinct_doc, cached, "output_tokens_per_s"),
                       at(distinct, distinct_doc, baseline, "output_tokens_per_s")),
                DISTINCT_TOK_S_ON_OVER_OFF, False),
    ]
    return {"targets": targets, "multi_turn": multi, "distinct": distinct, "prefix_cache_counters": counters,
            "workloads": {"multi_turn": multi_turn_doc["config"]["workload_summary"],
                          "distinct": distinct_doc["config"]["workload_summary"]},
            "environment": multi_turn_doc["environment"]}
