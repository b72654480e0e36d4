"""The ``--plot`` figure of ``stagemesh bench serve``, drawn from its report.

Contract: ``plot(report, path)`` writes a PNG with one row per load kind in the
report (concurrency, request rate) and three panels per row: output tok/s,
TTFT p50/p99 and ITL p50/p99 against the load, one colour per endpoint (p50
solid, p99 dashed). It uses matplotlib's Agg backend (no display needed) and
reads only the report, so a saved ``results.json`` can be re-plotted.
"""

from __future__ import annotations

from typing import Any

_XLABEL = {"concurrency": "concurrency (requests in flight)", "rate": "request rate (requests/s)"}


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: headless, and never opens a window
    import matplotlib.pyplot as plt

    # An infinite request rate ("inf": all at once) has no place on an axis; the table shows it.
    results = report["results"]
    levels = [m for m in results["levels"] if isinstance(m["load_value"], int | float)]
    kinds = list(dict.fromkeys(m["load"] for m in levels)) or ["concurrency"]
    labels = [e["label"] for e in results["endpoints"]]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(15, 4.2 * len(kinds)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, kind in zip(axes, kinds):
        for i, label in enumerate(labels):
            ms = sorted((m for m in levels if m["load"] == kind and m["endpoint"] == label),
                        key=lambda m: m["load_value"])
            if not ms:
                continue
            x = [m["load_value"] for m in ms]
            color = colors[i % len(colors)]

            def series(metric: str, stat: str, scale: float = 1000.0, ms=ms) -> list[float]:
                return [float("nan") if m[metric][stat] is None else m[metric][stat] * scale for m in ms]

            row[0].plot(x, [m["output_tokens_per_s"] or float("nan") for m in ms], "o-", color=color, label=label)
            for ax, metric in ((row[1], "ttft"), (row[2], "itl")):
                ax.plot(x, series(metric, "p50"), "o-", color=color, label=f"{label} p50")
                ax.plot(x, series(metric, "p99"), "x--", color=color, label=f"{label} p99")
        xs = sorted({m["load_value"] for m in levels if m["load"] == kind})
        titles = ("output tokens/s", "time to first token (ms)", "inter-token latency (ms)")
        for ax, title in zip(row, titles):
            ax.set_title(title)
            ax.set_xlabel(_XLABEL.get(kind, kind))
            if kind == "concurrency":
                ax.set_xscale("log", base=2)  # levels usually double; equal spacing per doubling
                ax.minorticks_off()
            ax.set_xticks(xs, [f"{v:g}" for v in xs])
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(f"stagemesh bench serve  {report['started_at']}  {report['config'].get('workload_summary', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
