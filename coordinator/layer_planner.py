"""Layer planner: which contiguous layers each stage holds, so that every stage fits its node's memory.

A pure function over plain values (no Ray, no MLX), so a plan is previewed by
``stagemesh plan`` and tested with made-up clusters:

- the nodes' facts (``StageSeat``: the ``NodeMemory`` each node reported about
  itself, and how many stages share its memory),
- the model's facts (``stagemesh.core.memory.ModelFacts``),
- the request (``PlanRequest``: ``--max-model-len``, ``--max-num-seqs``,
  ``--memory-fraction``, ``--dtype``, ``--pp-layer-split``).

The rule a stage must meet is the stage's own (``stage_worker.memory``): its
weights, the KV of one full-length sequence (``--max-model-len`` tokens) and
the runtime allowance fit its budget (``stagemesh.core.memory.budget_for``).
The planner asks for more: ``HEADROOM_FRACTION`` of each budget left over, so
that no stage is packed to the brim and every stage holds KV beyond a single
sequence. Whatever is left becomes the stage's KV capacity in tokens (the
pipeline's is its smallest stage's).

Among the splits that fit, it chooses the one whose slowest stage is fastest:
a stage's time per token is its layers' weight bytes over its node's speed
(decoding reads every weight once per step; ``STAGEMESH_NODE_SPEED``, 1 when
unknown). Ties go to the split with the most KV capacity in the pipeline's
smallest stage (the stages holding the embedding or head give up a layer
first). With equal nodes and room to spare that is the even split, or one
layer from it. ``--pp-layer-split`` overrides the choice and is checked by the
same rule.

A request that cannot fit raises ``PlanError`` before anything loads: which
stage is short by how many GB, the largest ``--max-model-len`` that would fit,
and how many more nodes of which size would make it fit.

``--max-num-seqs`` does not change what must fit: like vLLM, a stage must hold
one full-length sequence, and the scheduler admits sequences while the
pipeline's KV capacity lasts (requests queue beyond it). The plan reports how
many full-length sequences fit at once, and the ``--max-num-seqs`` or
``--max-model-len`` that would let every running sequence reach full length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stagemesh.core import defaults
from stagemesh.core.errors import UserError
from stagemesh.core.layer_split import LayerRange, even_split, parse_layer_split
from stagemesh.core.memory import RUNTIME_OVERHEAD_BYTES, ModelFacts, NodeMemory, dtype_bytes, resolved_dtype
from stagemesh.core.settings import MLX_RESOURCE

HEADROOM_FRACTION = 0.10  # of each stage's budget, left free beyond weights + one sequence + runtime
_GB = 1e9
_MAX_EXTRA_NODES = 32


class PlanError(UserError):
    """The model and request do not fit the cluster; the message gives the numbers and the ways out."""


@dataclass(frozen=True)
class StageSeat:
    """Where one stage runs: its node's own facts, and how many stages share that node's memory."""

    node_id: str
    address: str
    memory: NodeMemory
    stages_on_node: int = 1
    name: str = ""  # the node's hostname, for tables

    @property
    def label(self) -> str:
        return self.name or self.node_id[:8] or self.address


@dataclass(frozen=True)
class PlanRequest:
    max_model_len: int
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    memory_fraction: float = defaults.MEMORY_FRACTION
    compute_dtype: str = "auto"
    layer_split: str | None = None  # --pp-layer-split: checked, not chosen


@dataclass(frozen=True)
class PlannedStage:
    """One stage of a plan, with the numbers ``stagemesh plan`` prints."""

    replica: int
    rank: int
    node_id: str
    node: str  # hostname or short id
    address: str
    backend: str
    dtype: str
    layers: LayerRange
    budget_bytes: int
    weight_bytes: int
    kv_bytes_per_token: int  # across this stage's layers
    kv_tokens: int  # KV this stage holds: what its budget leaves after weights and runtime
    need_bytes: int  # weights + one --max-model-len sequence of KV + runtime
    speed: float = 1.0

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def headroom_bytes(self) -> int:
        """The budget left beyond what the stage must hold (weights, one full sequence, runtime)."""
        return self.budget_bytes - self.need_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica, "rank": self.rank, "node_id": self.node_id, "node": self.node,
            "address": self.address, "backend": self.backend, "dtype": self.dtype,
            "layers": [self.layers.start, self.layers.end], "budget_bytes": self.budget_bytes,
            "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes, "kv_tokens": self.kv_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token, "headroom_bytes": self.headroom_bytes,
            "speed": self.speed,
        }


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    replicas: tuple[tuple[PlannedStage, ...], ...]
    chosen_by: str  # "memory planner" or "--pp-layer-split"

    def ranges(self, replica: int) -> tuple[LayerRange, ...]:
        return tuple(s.layers for s in self.replicas[replica])

    def replica_kv_tokens(self, replica: int) -> int:
        """The pipeline's KV capacity: every stage holds every running token, so its smallest stage's."""
        return min(s.kv_tokens for s in self.replicas[replica])

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {
            "chosen_by": self.chosen_by,
            "request": {"max_model_len": r.max_model_len, "max_num_seqs": r.max_num_seqs,
                        "memory_fraction": r.memory_fraction, "dtype": r.compute_dtype,
                        "pp_layer_split": r.layer_split},
            "replicas": [{"replica": i, "kv_tokens": self.replica_kv_tokens(i),
                          "full_length_sequences": self.replica_kv_tokens(i) // r.max_model_len,
                          "stages": [s.to_json() for s in stages]} for i, stages in enumerate(self.replicas)],
        }


# -- one stage ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Cost:
    """One stage's seat under the request: the numbers that do not depend on its layer count."""

    budget: int
    element_bytes: int
    dtype: str
    layer_bytes: int  # weights of one layer
    kv_layer_token: int  # KV bytes of one token in one layer
    fixed_bytes: int  # embedding / head / final norm on the ends, plus the runtime

    def need(self, layers: int, max_model_len: int) -> int:
        return self.fixed_bytes + layers * (self.layer_bytes + self.kv_layer_token * max_model_len)

    def max_layers(self, max_model_len: int, limit: int) -> int:
        """Most layers this stage can take with its headroom left; 0 when not even one fits."""
        room = self.budget * (1 - HEADROOM_FRACTION) - self.fixed_bytes
        per_layer = self.layer_bytes + self.kv_layer_token * max_model_len
        return max(0, min(limit, int(room // per_layer))) if room > 0 else 0


def _cost(model: ModelFacts, seat: StageSeat, request: PlanRequest, *, first: bool, last: bool) -> _Cost:
    element = dtype_bytes(request.compute_dtype, seat.memory.backend)
    budget = seat.memory.budget(request.memory_fraction, seat.stages_on_node).budget_bytes
    ends = model.stage_weight_bytes(0, first=first, last=last, element_bytes=element)
    return _Cost(budget, element, resolved_dtype(request.compute_dtype, seat.memory.backend),
                 model.layer.nbytes(element), model.kv_bytes_per_token(1, element), ends + RUNTIME_OVERHEAD_BYTES)


def _costs(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest) -> list[_Cost]:
    last = len(seats) - 1
    return [_cost(model, seat, request, first=r == 0, last=r == last) for r, seat in enumerate(seats)]


def _planned(replica: int, rank: int, seat: StageSeat, cost: _Cost, layers: LayerRange,
             request: PlanRequest) -> PlannedStage:
    n = len(layers)
    weights = cost.fixed_bytes - RUNTIME_OVERHEAD_BYTES + n * cost.layer_bytes
    per_token = n * cost.kv_layer_token
    # Exactly what the stage will compute (stage_worker.memory.kv_token_capacity).
    tokens = max(0, (cost.budget - weights - RUNTIME_OVERHEAD_BYTES) // per_token) if per_token else 0
    return PlannedStage(
        replica=replica, rank=rank, node_id=seat.node_id, node=seat.label, address=seat.address,
        backend=seat.memory.backend, dtype=cost.dtype, layers=layers, budget_bytes=cost.budget,
        weight_bytes=weights, kv_bytes_per_token=per_token, kv_tokens=int(tokens),
        need_bytes=cost.need(n, request.max_model_len), speed=seat.memory.speed,
    )


# -- choosing a split -----------------------------------------------------------------------------


def _choose(costs: Sequence[_Cost], speeds: Sequence[float], num_layers: int, max_model_len: int) -> list[int] | None:
    """Layer counts per stage minimising the slowest stage's time, or None when no split fits."""
    caps = [c.max_layers(max_model_len, num_layers) for c in costs]
    if min(caps) < 1 or sum(caps) < num_layers:
        return None
    per_layer = [c.layer_bytes / s for c, s in zip(costs, speeds)]
    # The slowest stage's time is n * per_layer[r] for some stage r and count n: try those in order.
    candidates = sorted({n * t for t, cap in zip(per_layer, caps) for n in range(1, cap + 1)})
    for limit in candidates:
        counts = [min(cap, int(limit / t + 1e-9)) for cap, t in zip(caps, per_layer)]
        if min(counts) >= 1 and sum(counts) >= num_layers:
            return _trim(counts, sum(counts) - num_layers, costs, max_model_len)
    return None


def _trim(counts: list[int], excess: int, costs: Sequence[_Cost], max_model_len: int) -> list[int]:
    """Take ``excess`` layers away, each from the stage holding the fewest KV tokens (the later on a tie)."""
    def tokens(r: int) -> float:
        c, n = costs[r], counts[r]
        return (c.budget - c.need(n, 0)) / (n * c.kv_layer_token or 1)

    for _ in range(excess):
        r = min((r for r in range(len(counts)) if counts[r] > 1), key=lambda r: (tokens(r), -r))
        counts[r] -= 1
    return counts


def _ranges(counts: Sequence[int]) -> tuple[LayerRange, ...]:
    out, start = [], 0
    for n in counts:
        out.append(LayerRange(start, start + n))
        start += n
    return tuple(out)


def plan_pipeline(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest,
                  replica: int = 0) -> tuple[tuple[PlannedStage, ...], str]:
    """One replica's stages, and who chose the split; ``PlanError`` when it cannot fit."""
    if not seats:
        raise PlanError("a pipeline needs at least one stage")
    if request.max_model_len < 1:
        raise PlanError(f"--max-model-len must be at least 1, got {request.max_model_len}")
    pp = len(seats)
    even_split(model.num_layers, pp)  # refuses more stages than layers, naming the flag
    costs = _costs(model, seats, request)
    if request.layer_split:
        ranges = parse_layer_split(request.layer_split, model.num_layers, pp)
        _check_split(model, seats, request, costs, ranges, replica)
        chosen_by = "--pp-layer-split"
    else:
        counts = _choose(costs, [s.memory.speed for s in seats], model.num_layers, request.max_model_len)
        if counts is None:
            raise PlanError(_refusal(model, seats, request, costs, replica))
        ranges, chosen_by = _ranges(counts), "memory planner"
    return tuple(_planned(replica, r, seat, cost, layers, request)
                 for r, (seat, cost, layers) in enumerate(zip(seats, costs, ranges))), chosen_by


def plan_mesh(model: ModelFacts, replicas: Sequence[Sequence[StageSeat]], request: PlanRequest) -> MemoryPlan:
    """Every replica's plan (``replicas[i][rank]`` is where that stage runs)."""
    planned, chosen_by = [], "memory planner"
    for index, seats in enumerate(replicas):
        stages, chosen_by = plan_pipeline(model, seats, request, index)
        planned.append(stages)
    return MemoryPlan(request, tuple(planned), chosen_by)


# -- refusing, with numbers and ways out -----------------------------------------------------------


def _gb(n: float) -> str:
    """A size for messages: GB with two decimals, MB below one GB (a tiny model's layer is a few MB)."""
    return f"{n / _GB:.2f} GB" if abs(n) >= _GB else f"{n / 1e6:.0f} MB"


def _stage_line(rank: int, seat: StageSeat, cost: _Cost, request: PlanRequest) -> str:
    usable = seat.memory.usable_bytes()
    share = f" / {seat.stages_on_node} stages" if seat.stages_on_node > 1 else ""
    return (f"stage {rank} on {seat.label} ({seat.address}, {seat.memory.backend}): budget {_gb(cost.budget)} "
            f"(--memory-fraction {request.memory_fraction:g} x {_gb(usable)}{share})")


def _check_split(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest, costs: Sequence[_Cost],
                 ranges: Sequence[LayerRange], replica: int) -> None:
    problems = []
    for rank, (seat, cost, layers) in enumerate(zip(seats, costs, ranges)):
        need = cost.need(len(layers), request.max_model_len)
        allowed = int(cost.budget * (1 - HEADROOM_FRACTION))
        if need > allowed:
            problems.append(
                f"  {_stage_line(rank, seat, cost, request)} cannot hold layers {layers}: they need "
                f"{_gb(need)} (weights, one --max-model-len {request.max_model_len} sequence of KV, runtime), "
                f"more than the {_gb(allowed)} it may fill keeping {HEADROOM_FRACTION:.0%} headroom; "
                f"short by {_gb(need - allowed)}")
    if not problems:
        return
    chosen = _choose(costs, [s.memory.speed for s in seats], model.num_layers, request.max_model_len)
    way_out = (f"leave out --pp-layer-split and the planner chooses {_split_flag(chosen)}" if chosen else
               "no split of these stages fits; " + _ways_out(model, seats, request, replica))
    raise PlanError(f"--pp-layer-split {request.layer_split} does not fit replica {replica}:\n"
                    + "\n".join(problems) + f"\n{way_out}")


def _split_flag(counts: Sequence[int]) -> str:
    bounds, start = [], 0
    for n in counts[:-1]:
        start += n
        bounds.append(str(start))
    return f"--pp-layer-split {','.join(bounds)}" if bounds else "one stage"


def _refusal(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest, costs: Sequence[_Cost],
             replica: int) -> str:
    caps = [c.max_layers(request.max_model_len, model.num_layers) for c in costs]
    lines = [f"the model's {model.num_layers} layers with --max-model-len {request.max_model_len} do not fit "
             f"replica {replica}'s {len(seats)} stage(s) (each must keep {HEADROOM_FRACTION:.0%} of its budget "
             f"free); together they hold at most {sum(caps)} layers:"]
    for rank, (seat, cost, cap) in enumerate(zip(seats, costs, caps)):
        one = cost.need(1, request.max_model_len)
        allowed = cost.budget * (1 - HEADROOM_FRACTION)
        detail = (f"at most {cap} layer(s)" if cap >= 1 else
                  f"not even one layer: it needs {_gb(one)}, short by {_gb(one - allowed)}")
        lines.append(f"  {_stage_line(rank, seat, cost, request)}: {detail}")
    missing = model.num_layers - sum(caps)
    if missing > 0:
        widest = max(costs, key=lambda c: c.layer_bytes + c.kv_layer_token * request.max_model_len)
        short = missing * (widest.layer_bytes + widest.kv_layer_token * request.max_model_len)
        lines.append(f"  short by about {_gb(short / (1 - HEADROOM_FRACTION))} for the other {missing} layer(s) "
                     f"({_gb(widest.layer_bytes)} of weights + {_gb(widest.kv_layer_token * request.max_model_len)} "
                     f"of KV each)")
    lines.append("ways out: " + _ways_out(model, seats, request, replica))
    return "\n".join(lines)


def _fits(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest) -> bool:
    costs = _costs(model, seats, request)
    return _choose(costs, [s.memory.speed for s in seats], model.num_layers, request.max_model_len) is not None


def largest_max_model_len(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest) -> int:
    """The longest ``--max-model-len`` these stages fit (0: not even one token beside the weights)."""
    low, high = 0, request.max_model_len
    while low < high:
        middle = (low + high + 1) // 2
        if _fits(model, seats, _with(request, max_model_len=middle)):
            low = middle
        else:
            high = middle - 1
    return low


def _with(request: PlanRequest, **changes: Any) -> PlanRequest:
    return replace(request, layer_split=None, **changes)


def _ways_out(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest, replica: int) -> str:
    ways = []
    longest = largest_max_model_len(model, seats, request)
    if longest >= 1:
        ways.append(f"lower --max-model-len to {longest} or less")
    # A stage that cannot hold even one layer only helps when left out.
    useless = [s for s in seats if _cost(model, s, request, first=False, last=False).max_layers(
        request.max_model_len, model.num_layers) < 1]
    kept = [s for s in seats if s not in useless] or [max(seats, key=lambda s: s.memory.usable_bytes())]
    if useless:
        names = ", ".join(sorted({s.label for s in useless}))
        ways.append(f"leave {names} out (give it no '{MLX_RESOURCE}' unit): it cannot hold even one layer")
    biggest = max(kept, key=lambda s: s.memory.budget(request.memory_fraction, 1).budget_bytes)
    for extra in range(0 if useless else 1, min(_MAX_EXTRA_NODES, model.num_layers - len(kept)) + 1):
        grown = [*kept[:-1], *[StageSeat(f"new-{i}", "?", biggest.memory, 1, f"new node {i + 1}")
                               for i in range(extra)], kept[-1]]
        if _fits(model, grown, request):
            pp = len(grown)
            ways.append(f"add {extra} more node(s) with {_gb(biggest.memory.usable_bytes())} usable like "
                        f"{biggest.label} (one '{MLX_RESOURCE}' unit each) and set --pipeline-parallel-size {pp}"
                        if extra else f"set --pipeline-parallel-size {pp} on the nodes that can hold layers")
            break
    if request.memory_fraction < 0.95:
        ways.append(f"raise --memory-fraction above {request.memory_fraction:g} if nothing else runs there")
    if len(seats) > 1 and any(s.stages_on_node > 1 for s in seats):
        ways.append("spread the stages over more nodes (stages on one node share its memory)")
    return "; ".join(ways) if ways else "use a smaller or more quantized model"


# -- the table ------------------------------------------------------------------------------------


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: node, address, layers, weight GB, KV GB (tokens it holds), headroom (pure)."""
    header = ("replica", "rank", "node", "address", "backend", "layers", "weights GB", "KV GB (tokens)",
              "headroom GB")
    rows = [header]
    for stages in plan.replicas:
        for s in stages:
            rows.append((str(s.replica), str(s.rank), s.node, s.address, f"{s.backend} {s.dtype}",
                         f"{s.layers} x{len(s.layers)}", f"{s.weight_bytes / _GB:.2f}",
                         f"{s.kv_bytes / _GB:.2f} ({s.kv_tokens})", f"{s.headroom_bytes / _GB:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    r = plan.request
    for index in range(len(plan.replicas)):
        tokens = plan.replica_kv_tokens(index)
        full = tokens // r.max_model_len
        lines.append(f"replica {index}: KV for {tokens} tokens = {full} sequence(s) of --max-model-len "
                     f"{r.max_model_len} at once (--max-num-seqs {r.max_num_seqs}"
                     + ("" if full >= r.max_num_seqs else
                        f"; {r.max_num_seqs} full-length sequences at once would need --max-num-seqs {max(1, full)} "
                        f"or --max-model-len {max(1, tokens // r.max_num_seqs)}; shorter requests share the rest")
                     + ")")
    lines.append(f"layers chosen by the {plan.chosen_by}; each stage keeps {HEADROOM_FRACTION:.0%} of its budget "
                 f"as headroom beyond weights, one full sequence and {RUNTIME_OVERHEAD_BYTES / _GB:.2f} GB of runtime")
    return "\n".join(lines)
