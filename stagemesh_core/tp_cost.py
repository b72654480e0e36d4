"""What tensor parallelism costs per token against pipeline parallelism over the same link (pure).

Contract: ``compare_tp_pp(stages, tp, link)`` says whether ``-pp P -tp T`` is expected to decode one stream
faster than ``-pp P*T`` on the same workers (the model is in its docstring), from figures whose source is
named (``Figure.source``): "measured" (``stagemesh doctor --tp-link``, read by ``link_from_doctor``),
"given" (a flag), "published" (a chip's specified memory bandwidth, ``published_bandwidth``) or "assumed"
(``assumed_link``: others' measurements, named). A figure nobody gave is missing, never invented: the
verdict is then decided by bounds where they settle it, else "unknown" with what to give.
``format_comparison`` writes the lines ``stagemesh plan`` prints. ``allreduces_per_layer`` counts what a
layer of each architecture sums under -tp.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stagemesh_core.errors import UserError

SOURCES = ("measured", "given", "published", "assumed")

# All-reduces per decoder layer under -tp. Dense layers cut by stagemesh (llama / qwen2 / qwen3:
# ``tensor_parallel.shard_layers``) sum after o_proj and after down_proj. mlx-lm's own ``shard()`` does the
# same for its dense layers, and for MoE layers (qwen3_moe, gpt_oss, deepseek_v3, glm4_moe) it shards the
# experts in place and sums once in the MoE block, after the attention's o_proj sum: 2 again. minimax also
# shards its q/k RMS norms across the heads, each summing its squares over the group: 2 more.
DEFAULT_ALLREDUCES_PER_LAYER = 2
ALLREDUCES_PER_LAYER = {"minimax": 4}

# Figures used when nothing was measured or given; printed as "assumed" with their source.
ASSUMED_ALLREDUCE_US: dict[str, tuple[float, str]] = {
    "ring": (300.0, "TCP ring between Macs over Thunderbolt as exo reports it (Jeff Geerling, Dec 2025)"),
    "jaccl": (30.0, "JACCL RDMA over Thunderbolt 5, 27-31 us measured inside an application by others"),
}

# Specified memory bandwidth per chip in GB/s (Apple's and NVIDIA's own figures); where a chip comes in
# binnings with different bandwidth, the lower one (the name does not say which).
PUBLISHED_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    (r"\bM1 Ultra\b", 800.0), (r"\bM1 Max\b", 400.0), (r"\bM1 Pro\b", 200.0), (r"\bM1\b", 68.25),
    (r"\bM2 Ultra\b", 800.0), (r"\bM2 Max\b", 400.0), (r"\bM2 Pro\b", 200.0), (r"\bM2\b", 100.0),
    (r"\bM3 Ultra\b", 819.0), (r"\bM3 Max\b", 300.0), (r"\bM3 Pro\b", 150.0), (r"\bM3\b", 100.0),
    (r"\bM4 Max\b", 410.0), (r"\bM4 Pro\b", 273.0), (r"\bM4\b", 120.0),
    (r"\bH200\b", 4800.0), (r"\bH100\b.*\bPCIe\b", 2000.0), (r"\bH100\b", 3350.0),
    (r"\bA100\b.*\b80GB\b", 2039.0), (r"\bA100\b", 1555.0),
)


@dataclass(frozen=True)
class Figure:
    """A number and where it came from."""

    value: float
    source: str  # one of SOURCES
    detail: str  # where, in words (the command, the flag, the chip, the report)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"figure source {self.source!r}: one of {', '.join(SOURCES)}")
        if not self.value > 0:
            raise UserError(f"{self.detail}: a figure must be positive, got {self.value}")


@dataclass(frozen=True)
class LinkFigures:
    """The group's link: one all-reduce of a decode row, and (where measured) a -pp hop of the same row."""

    backend: str
    allreduce_us: Figure | None  # one all-reduce of a [1, hidden] row in the compute dtype
    hop_us: Figure | None = None  # one hop of that row between the same two hosts (one way)
    bandwidth_gbs: Figure | None = None  # what one node streams from memory (measured with the link)
    prefill_allreduce_us: Figure | None = None  # one all-reduce of [prefill_rows, hidden]
    prefill_rows: int = 0
    hidden_size: int | None = None  # of the row measured (None: not said)
    dtype: str | None = None


@dataclass(frozen=True)
class GroupStage:
    """One stage of the replica as ``-tp T`` would run it."""

    layers: int
    streamed_bytes: int  # the whole stage's weights read per decode token (at -tp 1)
    bandwidth_gbs: Figure | None  # its node's memory bandwidth; None: unknown
    one_node: bool  # every worker of its group on one node (they share its memory bandwidth)
    allreduces_per_layer: int = DEFAULT_ALLREDUCES_PER_LAYER


@dataclass(frozen=True)
class TpComparison:
    """``compare_tp_pp``'s answer, all times in microseconds per decoded token of one stream."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    allreduces_per_token: int
    allreduce_us_per_token: float | None  # None: no all-reduce figure
    weights_saved_us_per_token: float | None  # what -tp's parallel streaming saves; None: a bandwidth missing
    extra_hops: int  # hops -pp P*T crosses beyond -pp P -tp T's
    hop_us: float | None  # one hop: measured, else None
    hop_bound_us: float | None  # the hop's upper bound used when not measured (the all-reduce)
    verdict: str  # "tp" (-tp expected faster), "pp" (-pp expected faster) or "unknown"
    margin_us_per_token: float | None  # pp's time less tp's (positive: tp faster), where both are known
    missing: tuple[str, ...]  # what would decide an "unknown", in words

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def allreduces_per_layer(model_type: str | None) -> int:
    """All-reduces each decoder layer of ``model_type`` runs under -tp (see ``ALLREDUCES_PER_LAYER``)."""
    return ALLREDUCES_PER_LAYER.get(model_type or "", DEFAULT_ALLREDUCES_PER_LAYER)


def published_bandwidth(device: str | None) -> Figure | None:
    """The chip's specified memory bandwidth from its device name (e.g. "Apple M2 Max"); None: not a chip
    this table knows (a CPU, an unknown GPU)."""
    for pattern, gbs in PUBLISHED_BANDWIDTH_GBS:
        if device and re.search(pattern, device):
            return Figure(gbs, "published", f"{device}'s specified memory bandwidth")
    return None


def assumed_link(backend: str) -> LinkFigures:
    """The all-reduce figure to plan with when none was measured or given (None for a backend without one)."""
    found = ASSUMED_ALLREDUCE_US.get(backend)
    figure = Figure(found[0], "assumed", found[1]) if found else None
    return LinkFigures(backend, figure)


def given_link(backend: str, allreduce_us: float, flag: str = "--tp-link-latency-us") -> LinkFigures:
    return LinkFigures(backend, Figure(allreduce_us, "given", flag))


def link_from_doctor(report: Mapping[str, Any], path: str = "the report") -> LinkFigures:
    """The figures of ``stagemesh doctor --tp-link --json``'s report (its ``tp_link``, or that object
    itself); ``UserError`` naming what to run where it holds none."""
    data = report.get("tp_link", report)
    if not isinstance(data, Mapping) or "allreduce_us" not in data:
        raise UserError(f"{path} holds no all-reduce measurement: write it with "
                        "`stagemesh doctor --tp-link --json > FILE`")
    if data.get("error"):
        raise UserError(f"{path}: the measurement failed ({data['error']}); fix that and measure again")
    hosts = " and ".join(data.get("hosts", ())) or "two processes"
    where = f"stagemesh doctor --tp-link between {hosts}" + (f" at {data['measured_at']}"
                                                             if data.get("measured_at") else "")
    decode = data["allreduce_us"]["decode"]["median"]
    prefill = data["allreduce_us"].get("prefill")
    hop = (data.get("hop_us") or {}).get("median")
    bandwidths = [b for b in data.get("memory_bandwidth_gbs", ()) if b]
    return LinkFigures(
        backend=str(data["backend"]),
        allreduce_us=Figure(float(decode), "measured", where),
        hop_us=Figure(float(hop), "measured", "stagemesh doctor --tp-link, TCP one way") if hop else None,
        bandwidth_gbs=Figure(float(min(bandwidths)), "measured", "stagemesh doctor --tp-link, the slower node's "
                             "matrix-vector product") if bandwidths else None,
        prefill_allreduce_us=Figure(float(prefill["median"]), "measured", where) if prefill else None,
        prefill_rows=int(data.get("prefill_rows", 0)), hidden_size=data.get("hidden_size"),
        dtype=data.get("dtype"))


def stage_saving_us(stage: GroupStage, tp: int) -> float | None:
    """Microseconds per token -tp T saves on ``stage``'s weight streaming (None: its bandwidth unknown)."""
    if stage.one_node:
        return 0.0  # the workers stream from one memory: 1/T each, T at once, no faster
    if stage.bandwidth_gbs is None:
        return None
    return stage.streamed_bytes * (1 - 1 / tp) / (stage.bandwidth_gbs.value * 1e3)  # GB/s = 1e3 bytes per µs


def compare_tp_pp(stages: Sequence[GroupStage], tp: int, link: LinkFigures) -> TpComparison:
    """Would ``-pp P -tp T`` (P = ``len(stages)``, T = ``tp``) decode one stream faster than ``-pp P*T``?

    One stream's decode step (what -tp is for: one conversation's latency; with many streams in flight -pp
    keeps every stage busy and the question is throughput's) is bound by the weight bytes it streams. Under
    -tp each stage's T workers stream 1/T of its weights at once (the MLP split balances what each reads:
    ``balance_intermediate``), then sum partial products: ``allreduces_per_layer`` all-reduces of a
    ``[1, hidden]`` row per layer, and P hops per token. Under -pp P*T one worker at a time streams each
    slice in turn, and a token crosses P*T hops. So -tp saves ``streamed_bytes * (1 - 1/T) / bandwidth`` per
    stage (nothing where the group's workers share one node: they stream from one memory) plus ``P*(T-1)``
    hops, and pays ``layers * allreduces_per_layer`` all-reduces. An unmeasured hop is bounded by the
    all-reduce over the same link (a hop sends the row one way; a two-worker all-reduce exchanges it both
    ways, a larger ring takes more steps), which settles many plans without it."""
    if tp < 2 or not stages:
        raise ValueError(f"a comparison needs -tp 2 or more and a stage, got -tp {tp} and {len(stages)} stages")
    pp = len(stages)
    count = sum(s.layers * s.allreduces_per_layer for s in stages)
    extra_hops = pp * (tp - 1)
    ar = link.allreduce_us.value if link.allreduce_us else None
    cost = count * ar if ar is not None else None
    savings = [stage_saving_us(s, tp) for s in stages]
    saved = sum(x for x in savings if x is not None) if all(x is not None for x in savings) else None
    known_saved = sum(x for x in savings if x is not None)  # a lower bound where some are unknown
    hop = link.hop_us.value if link.hop_us else None
    hop_bound = ar if hop is None else None
    missing = []
    if cost is None:
        missing.append(f"the {link.backend} all-reduce latency (stagemesh doctor --tp-link, or "
                       "--tp-link-latency-us)")
    if saved is None:
        missing.append("the nodes' memory bandwidth (stagemesh doctor --tp-link measures it)")
    verdict, margin = "unknown", None
    if cost is not None:
        if saved is not None and hop is not None:
            margin = saved + extra_hops * hop - cost
            verdict = "tp" if margin > 0 else "pp"
        elif known_saved > cost:  # -tp is ahead on the weights it knows of alone: hops only add to that
            verdict = "tp"
        elif saved is not None and hop_bound is not None and saved + extra_hops * hop_bound <= cost:
            verdict = "pp"  # even hops as slow as an all-reduce would not make up for the all-reduces
        if verdict == "unknown" and hop is None and saved is not None:
            missing.append("the hop latency between the hosts (stagemesh doctor --tp-link measures it)")
    return TpComparison(tp, pp, count, cost, saved, extra_hops, hop, hop_bound, verdict,
                        margin, tuple(missing))


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f} ms"


def _source(figure: Figure) -> str:
    return f"{figure.source}: {figure.detail}"


def format_comparison(c: TpComparison, link: LinkFigures, stages: Sequence[GroupStage],
                      hidden_size: int | None = None, dtype: str | None = None) -> list[str]:
    """``compare_tp_pp``'s answer as the plan's lines (pure)."""
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    row = f"[1, {hidden_size}]" if hidden_size else "[1, hidden]"
    lines = []
    if link.allreduce_us is None:
        lines.append(f"-tp {tp} over {link.backend}: no all-reduce latency known for this backend; measure it "
                     f"(stagemesh doctor --tp-link --tp-backend {link.backend} --json > link.json, then "
                     "--tp-link link.json) or state it (--tp-link-latency-us US)")
    else:
        lines.append(f"-tp {tp} over {link.backend}: one all-reduce of a {row} {link.dtype or dtype or ''} row "
                     f"{link.allreduce_us.value:.1f} us ({_source(link.allreduce_us)})".replace("  ", " "))
        if link.allreduce_us.source == "assumed":
            lines.append("  that latency is an assumption, not this link's: measure yours with stagemesh doctor "
                         f"--tp-link --tp-backend {link.backend} --json > link.json and plan with --tp-link "
                         "link.json")
        if link.hidden_size and hidden_size and link.hidden_size != hidden_size:
            lines.append(f"  measured with hidden size {link.hidden_size}, the model's is {hidden_size}: measure "
                         f"again with --hidden-size {hidden_size} (or --model) for this model's row")
        if link.dtype and dtype and link.dtype != dtype:
            lines.append(f"  measured in {link.dtype}, the stages compute in {dtype}: measure again with --dtype "
                         f"{dtype} for this plan's row")
        per_layer = sorted({s.allreduces_per_layer for s in stages})
        lines.append(f"  all-reduces per token: {c.allreduces_per_token} ({'/'.join(map(str, per_layer))} per layer "
                     f"x {sum(s.layers for s in stages)} layers) = {_ms(c.allreduce_us_per_token or 0)}")
        if link.prefill_allreduce_us is not None and link.prefill_rows:
            per_chunk = c.allreduces_per_token * link.prefill_allreduce_us.value
            lines.append(f"  a prefill chunk of {link.prefill_rows} tokens: {link.prefill_allreduce_us.value:.1f} us "
                         f"per all-reduce, {_ms(per_chunk)} per chunk")
    bandwidths = {(_source(s.bandwidth_gbs), s.bandwidth_gbs.value) for s in stages if s.bandwidth_gbs}
    shared = sum(1 for s in stages if s.one_node)
    saved = ("unknown (" + "; ".join(m for m in c.missing if "bandwidth" in m) + ")"
             if c.weights_saved_us_per_token is None else _ms(c.weights_saved_us_per_token))
    lines.append(f"  -tp saves {saved} per token of weight streaming ("
                 + (f"{sum(s.streamed_bytes for s in stages) / 1e9:.2f} GB read per token, 1/{tp} per worker"
                    + "".join(f"; {gbs:.0f} GB/s ({src})" for src, gbs in sorted(bandwidths)))
                 + (f"; {shared} of {len(stages)} group(s) on one node, whose workers share its memory bandwidth: "
                    "nothing saved there" if shared else "") + ")")
    if c.hop_us is not None:
        hop = f"{c.extra_hops} hop(s) -pp {pp * tp} would add, {c.hop_us:.1f} us each ({_source(link.hop_us)})" \
            if link.hop_us else ""
    else:
        hop = (f"{c.extra_hops} hop(s) -pp {pp * tp} would add, not measured: counted at most one all-reduce each"
               if c.hop_bound_us is not None else f"{c.extra_hops} hop(s) -pp {pp * tp} would add, not measured")
    lines.append(f"  and {hop}")
    if c.verdict == "tp":
        by = f" by {_ms(c.margin_us_per_token)} per token" if c.margin_us_per_token is not None else ""
        lines.append(f"  expected: -tp {tp} faster than -pp {pp * tp} for one stream{by}")
    elif c.verdict == "pp":
        by = f" by {_ms(-c.margin_us_per_token)} per token" if c.margin_us_per_token is not None else ""
        lines.append(f"  expected: -tp {tp} over this link SLOWER than -pp {pp * tp} for one stream{by}: serve "
                     f"-pp {pp * tp} instead, or a faster link (--tp-backend jaccl over Thunderbolt 5)")
    else:
        lines.append("  expected: unknown until it has " + " and ".join(c.missing))
    return lines


__all__ = ["Figure", "LinkFigures", "GroupStage", "TpComparison", "allreduces_per_layer", "published_bandwidth",
           "assumed_link", "given_link", "link_from_doctor", "compare_tp_pp", "format_comparison",
           "stage_saving_us", "ASSUMED_ALLREDUCE_US", "PUBLISHED_BANDWIDTH_GBS", "ALLREDUCES_PER_LAYER"]
