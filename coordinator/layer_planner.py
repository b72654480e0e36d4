"""Layer planner: which contiguous layers each stage holds, so that every stage fits its node's memory.

``plan_pipeline`` (one replica) and ``plan_mesh`` (every replica: a ``MemoryPlan``) are pure functions over
plain values, no Ray and no MLX: the nodes' facts (``StageSeat``), the model's (``ModelFacts``) and the
request (``PlanRequest``). ``format_plan`` prints a plan; ``largest_max_model_len`` finds the longest context
that fits. ``coordinator.hosts`` plans before launching; ``coordinator.plan_preview`` serves ``stagemesh plan``.
With ``--kv-cache-dtype q8`` or ``q4`` the model's facts count KV as it is stored
(``ModelFacts.with_kv_cache_dtype``), and ``plan_mesh`` given the same model's ``auto`` facts also plans the
same seats with them (``auto_kv_tokens``), so the plan states the context the choice buys.

A stage must fit its weights, KV for one ``--max-model-len`` sequence and the runtime in its budget, as the
stage itself counts them (``stage_worker.service.memory``), and keep ``HEADROOM_FRACTION`` free; the rest is its KV
capacity. Among the splits that fit, the planner picks the one whose slowest stage is fastest;
``--pp-layer-split`` overrides the choice and is checked by the same rule. A request that cannot fit raises
``PlanError`` before anything loads, with the numbers and the ways out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from stagemesh_core import defaults
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import AUTO, KVCacheDtype
from stagemesh_core.layer_split import LayerRange, even_split, parse_layer_split
from stagemesh_core.memory import (
    RUNTIME_OVERHEAD_BYTES,
    DraftFacts,
    ModelFacts,
    NodeMemory,
    StageKV,
    TensorBytes,
    dtype_bytes,
    kv_capacity_tokens,
    resolved_dtype,
)
from stagemesh_core.settings import MLX_RESOURCE

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
    """What the user asked for: ``--max-model-len``, ``--max-num-seqs``, ``--memory-fraction``, ``--dtype``,
    ``--pp-layer-split`` and the draft model.

    Beyond the sliding windows and recurrent states a stage holds for each sequence, ``max_num_seqs`` does not
    change what must fit: like vLLM, a stage must hold one full-length sequence of positions, and the scheduler
    admits sequences while the pipeline's KV capacity lasts (requests queue beyond it). The plan reports how
    many full-length sequences fit at once, and the ``--max-num-seqs`` or ``--max-model-len`` that would let
    every running sequence reach full length. With a ``draft``, each replica's first stage also holds the
    draft's weights and KV for the sequences that may speculate, counted like its own weights before its KV
    capacity, as the stage counts it.
    """

    max_model_len: int
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    memory_fraction: float = defaults.MEMORY_FRACTION
    compute_dtype: str = "auto"
    layer_split: str | None = None  # --pp-layer-split: checked, not chosen
    # --speculative-config's draft model, held by each replica's entry stage beside its slice; None: no draft.
    draft: DraftFacts | None = None
    # --kv-cache-dtype: how the model's facts count KV (the facts carry it: ModelFacts.with_kv_cache_dtype);
    # here to be stated beside the tokens it buys.
    kv_cache_dtype: KVCacheDtype = AUTO


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
    kv_bytes_per_token: int  # one more position in this stage's full-context layers
    kv_tokens: int  # KV this stage holds: what its budget leaves after weights and runtime
    kv_bytes: int  # what those positions may take (sliding windows and recurrent state of --max-num-seqs included)
    need_bytes: int  # weights + KV for one --max-model-len sequence + runtime (+ the draft model's share)
    speed: float = 1.0
    draft_bytes: int = 0  # the entry stage's draft model: its weights and its speculating sequences' KV

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
            "speed": self.speed, "draft_bytes": self.draft_bytes,
        }


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    replicas: tuple[tuple[PlannedStage, ...], ...]
    chosen_by: str  # "memory planner" or "--pp-layer-split"
    # With a quantized --kv-cache-dtype: each replica's KV tokens were its KV stored in the compute dtype
    # (``auto_kv_tokens``; None where auto does not fit); empty when the plan is auto's or was not compared.
    auto_kv_tokens: tuple[int | None, ...] = ()

    def kv_gain(self, replica: int) -> float | None:
        """How many times auto's KV tokens ``replica`` holds with the plan's --kv-cache-dtype (None: not
        compared, or auto does not fit)."""
        auto = self.auto_kv_tokens[replica] if replica < len(self.auto_kv_tokens) else None
        return self.replica_kv_tokens(replica) / auto if auto else None

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
            "kv_cache_dtype": {"name": r.kv_cache_dtype.name, "bits": r.kv_cache_dtype.bits,
                               "group_size": r.kv_cache_dtype.group_size},
            "replicas": [{"replica": i, "kv_tokens": self.replica_kv_tokens(i),
                          "full_length_sequences": self.replica_kv_tokens(i) // r.max_model_len,
                          **({"auto_kv_tokens": self.auto_kv_tokens[i], "kv_tokens_vs_auto": self.kv_gain(i)}
                             if self.auto_kv_tokens else {}),
                          "stages": [s.to_json() for s in stages]} for i, stages in enumerate(self.replicas)],
        }


# -- one stage ------------------------------------------------------------------------------------


class _Layers:
    """Prefix sums over the model's layers, so any slice's weights and KV cost O(1) (the split search asks
    for many slices). ``kv`` equals ``ModelFacts.slice_kv``, the count the stage sizes its KV by.

    Every slice is sized exactly, layer by layer (``ModelFacts.layer_sizes``: dense first layers beside
    expert layers, linear-attention layers beside attention ones), and KV by layer kind
    (``ModelFacts.kv_layers``): a full-context layer's keys and values (MLA's latent) per position, a
    sliding-window layer's bounded by its window per sequence, a linear-attention layer's recurrent state a
    fixed size per sequence; windows and states count for ``--max-num-seqs`` sequences.
    """

    def __init__(self, model: ModelFacts) -> None:
        self.model = model
        kvs = [model.layer_kv(i) for i in range(model.num_layers)]
        self._windows = sorted({kv.window for kv in kvs if kv.window is not None})
        self._per_token = _prefix([0 if kv.window is not None else kv.per_token for kv in kvs])
        self._packed_per_token = _prefix([0 if kv.window is not None else kv.packed_per_token for kv in kvs])
        self._window_sums = {w: _prefix([kv.per_token if kv.window == w else 0 for kv in kvs])
                             for w in self._windows}
        self._state_packed = _prefix([kv.state.packed for kv in kvs])
        self._state_elements = _prefix([kv.state.elements for kv in kvs])
        self._sizes: dict[int, list[int]] = {}

    def layer_bytes(self, start: int, end: int, element_bytes: int) -> int:
        if element_bytes not in self._sizes:
            self._sizes[element_bytes] = _prefix([self.model.layer_bytes(i, element_bytes)
                                                  for i in range(self.model.num_layers)])
        sums = self._sizes[element_bytes]
        return sums[end] - sums[start]

    def kv(self, start: int, end: int) -> StageKV:
        windows = tuple((self._window_sums[w][end] - self._window_sums[w][start], w) for w in self._windows)
        return StageKV(self._per_token[end] - self._per_token[start], tuple(x for x in windows if x[0]),
                       TensorBytes(self._state_packed[end] - self._state_packed[start],
                                   self._state_elements[end] - self._state_elements[start]),
                       packed_per_token=self._packed_per_token[end] - self._packed_per_token[start])


def _prefix(values: Sequence[int]) -> list[int]:
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


@dataclass(frozen=True)
class _Cost:
    """One stage's seat under the request: what any slice of layers costs there.

    A slice fits when its weights, KV for one full-length sequence (counted as
    ``stagemesh_core.memory.StageKV`` counts it) and the runtime allowance stay within ``allowed``: the
    budget (``stagemesh_core.memory.budget_for``) less ``HEADROOM_FRACTION``, so that no stage is packed to
    the brim and every stage holds KV beyond a single sequence. Whatever is left becomes the stage's KV
    capacity (``tokens``), computed exactly as the stage computes it.
    """

    layers: _Layers
    budget: int
    element_bytes: int
    dtype: str
    ends_bytes: int  # embedding / head / final norm on the ends
    speed: float
    max_sequences: int  # --max-num-seqs: sequences whose windows and states the KV must hold
    draft_bytes: int = 0  # the entry stage's draft model (``DraftFacts.reserved_bytes``), beside its slice

    @property
    def allowed(self) -> int:
        return int(self.budget * (1 - HEADROOM_FRACTION))

    def weights(self, start: int, end: int) -> int:
        return self.ends_bytes + self.layers.layer_bytes(start, end, self.element_bytes)

    def kv_bytes(self, start: int, end: int, tokens: int) -> int:
        return self.layers.kv(start, end).reserved_bytes(tokens, self.element_bytes, self.max_sequences)

    def need(self, start: int, end: int, max_model_len: int) -> int:
        """Weights, KV of one --max-model-len sequence (as the stage counts it) and the runtime."""
        return (self.weights(start, end) + self.kv_bytes(start, end, max_model_len) + RUNTIME_OVERHEAD_BYTES
                + self.draft_bytes)

    def fits(self, start: int, end: int, max_model_len: int) -> bool:
        return self.need(start, end, max_model_len) <= self.allowed

    def tokens(self, start: int, end: int, max_model_len: int) -> int:
        """Exactly what the stage will compute (``stage_worker.service.memory.kv_token_capacity``)."""
        room = self.budget - self.weights(start, end) - RUNTIME_OVERHEAD_BYTES - self.draft_bytes
        return kv_capacity_tokens(room, self.layers.kv(start, end), self.element_bytes, self.max_sequences,
                                  max_model_len)

    def time(self, start: int, end: int) -> float:
        """Time per token: decoding reads every weight of the stage's layers once per step."""
        return self.layers.layer_bytes(start, end, self.element_bytes) / self.speed

    def most_layers(self, num_layers: int, max_model_len: int, start: int | None = None) -> int:
        """The most consecutive layers this seat can hold (from ``start``, or from anywhere); 0 when none."""
        starts = range(num_layers) if start is None else (start,)
        best = 0
        for s in starts:
            n = best + 1  # only a longer run than the best so far matters
            while s + n <= num_layers and self.fits(s, s + n, max_model_len):
                best, n = n, n + 1
        return best


def _costs(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest,
           layers: _Layers | None = None) -> list[_Cost]:
    table = layers or _Layers(model)
    last = len(seats) - 1
    return [_cost(table, seat, request, first=r == 0, last=r == last) for r, seat in enumerate(seats)]


def _cost(layers: _Layers, seat: StageSeat, request: PlanRequest, *, first: bool, last: bool) -> _Cost:
    element = dtype_bytes(request.compute_dtype, seat.memory.backend)
    budget = seat.memory.budget(request.memory_fraction, seat.stages_on_node).budget_bytes
    ends = layers.model.ends_bytes(first=first, last=last, element_bytes=element)
    draft = request.draft.reserved_bytes(element, request.max_model_len) if first and request.draft else 0
    return _Cost(layers, budget, element, resolved_dtype(request.compute_dtype, seat.memory.backend), ends,
                 seat.memory.speed, request.max_num_seqs, draft)


def _planned(replica: int, rank: int, seat: StageSeat, cost: _Cost, layers: LayerRange,
             request: PlanRequest) -> PlannedStage:
    start, end = layers.start, layers.end
    tokens = cost.tokens(start, end, request.max_model_len)
    return PlannedStage(
        replica=replica, rank=rank, node_id=seat.node_id, node=seat.label, address=seat.address,
        backend=seat.memory.backend, dtype=cost.dtype, layers=layers, budget_bytes=cost.budget,
        weight_bytes=cost.weights(start, end),
        kv_bytes_per_token=cost.layers.kv(start, end).per_token_bytes(cost.element_bytes), kv_tokens=tokens,
        kv_bytes=cost.kv_bytes(start, end, tokens), need_bytes=cost.need(start, end, request.max_model_len),
        speed=seat.memory.speed, draft_bytes=cost.draft_bytes,
    )


# -- choosing a split -----------------------------------------------------------------------------


def _greedy(costs: Sequence[_Cost], num_layers: int, max_model_len: int, time_limit: float | None = None,
            min_tokens: int = 0) -> list[int] | None:
    """The split giving each stage in turn as many layers as it can take (fitting its memory, its time per token
    within ``time_limit``, its KV capacity at least ``min_tokens``) while every later stage keeps one; None when
    no split meets those limits. Every limit only tightens as a stage's slice grows, so if any split meets
    them this one does (each of its boundaries lies at or after that split's, by induction)."""
    counts, start = [], 0
    for rank, cost in enumerate(costs):
        if rank == len(costs) - 1:
            end = num_layers if _within(cost, start, num_layers, max_model_len, time_limit, min_tokens) else start
        else:
            end, last = start, num_layers - (len(costs) - 1 - rank)  # every later stage keeps a layer
            while end < last and _within(cost, start, end + 1, max_model_len, time_limit, min_tokens):
                end += 1
        if end == start:
            return None
        counts.append(end - start)
        start = end
    return counts


def _within(cost: _Cost, start: int, end: int, max_model_len: int, time_limit: float | None,
            min_tokens: int) -> bool:
    return (cost.fits(start, end, max_model_len)
            and (time_limit is None or cost.time(start, end) <= time_limit)
            and (not min_tokens or cost.tokens(start, end, max_model_len) >= min_tokens))


def _choose(costs: Sequence[_Cost], num_layers: int, max_model_len: int) -> list[int] | None:
    """Layer counts per stage minimising the slowest stage's time, then maximising the smallest stage's KV
    capacity; None when no split fits.

    A stage's time per token is its layers' weight bytes over its node's speed (decoding reads every weight
    once per step; ``STAGEMESH_NODE_SPEED``, 1 when unknown). Remaining ties go to earlier stages holding
    more layers. With equal nodes, equal layers and room to spare that is the even split, or one layer from it.
    """
    if _greedy(costs, num_layers, max_model_len) is None:
        return None
    # The slowest stage's time is one stage's time over some slice: search those values for the least that fits.
    times = sorted({c.time(s, e) for c in costs for s in range(num_layers) for e in range(s + 1, num_layers + 1)})
    low, high = 0, len(times) - 1
    while low < high:
        middle = (low + high) // 2
        if _greedy(costs, num_layers, max_model_len, times[middle]) is None:
            low = middle + 1
        else:
            high = middle
    limit = times[low]
    # Ties go to the most KV capacity in the pipeline's smallest stage.
    least, most = 0, max(c.tokens(i, i + 1, max_model_len) for c in costs for i in range(num_layers))
    while least < most:
        middle = (least + most + 1) // 2
        if _greedy(costs, num_layers, max_model_len, limit, middle) is None:
            most = middle - 1
        else:
            least = middle
    return _greedy(costs, num_layers, max_model_len, limit, least)


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
        counts = _choose(costs, model.num_layers, request.max_model_len)
        if counts is None:
            raise PlanError(_refusal(model, seats, request, costs, replica))
        ranges, chosen_by = _ranges(counts), "memory planner"
    return tuple(_planned(replica, r, seat, cost, layers, request)
                 for r, (seat, cost, layers) in enumerate(zip(seats, costs, ranges))), chosen_by


def plan_mesh(model: ModelFacts, replicas: Sequence[Sequence[StageSeat]], request: PlanRequest,
              auto_model: ModelFacts | None = None) -> MemoryPlan:
    """Every replica's plan (``replicas[i][rank]`` is where that stage runs). ``auto_model``: the same model
    with its KV in the compute dtype, given when ``model`` counts it quantized: each replica is also planned
    with it (``auto_kv_tokens``), for the plan's ``kv_gain``."""
    planned, chosen_by = [], "memory planner"
    for index, seats in enumerate(replicas):
        stages, chosen_by = plan_pipeline(model, seats, request, index)
        planned.append(stages)
    auto = (tuple(auto_kv_tokens(auto_model, seats, request, index) for index, seats in enumerate(replicas))
            if auto_model is not None else ())
    return MemoryPlan(request, tuple(planned), chosen_by, auto)


def auto_kv_tokens(auto_model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest,
                   replica: int = 0) -> int | None:
    """The KV tokens replica ``replica`` would hold with ``--kv-cache-dtype auto``: the same planner over the
    same seats and request with ``auto_model`` (the model's KV in the compute dtype), so a quantized plan's
    gain is counted by the same byte math as the plan itself (pure). None when auto does not fit (the
    quantized KV is then what makes the request fit)."""
    try:
        stages, _ = plan_pipeline(auto_model, seats, replace(request, kv_cache_dtype=AUTO), replica)
    except PlanError:
        return None
    return min(s.kv_tokens for s in stages)


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
        need = cost.need(layers.start, layers.end, request.max_model_len)
        if need > cost.allowed:
            problems.append(
                f"  {_stage_line(rank, seat, cost, request)} cannot hold layers {layers}: they need "
                f"{_gb(need)} (weights, one --max-model-len {request.max_model_len} sequence of KV, runtime), "
                f"more than the {_gb(cost.allowed)} it may fill keeping {HEADROOM_FRACTION:.0%} headroom; "
                f"short by {_gb(need - cost.allowed)}")
    if not problems:
        return
    chosen = _choose(costs, model.num_layers, request.max_model_len)
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
    """``PlanError``'s message: which stage is short by how many GB, the largest ``--max-model-len`` that
    would fit, and how many more nodes of which size would make it fit."""
    length = request.max_model_len
    caps = [c.most_layers(model.num_layers, length) for c in costs]
    lines = [f"the model's {model.num_layers} layers with --max-model-len {length} do not fit "
             f"replica {replica}'s {len(seats)} stage(s) (each must keep {HEADROOM_FRACTION:.0%} of its budget "
             f"free); together they hold at most {sum(caps)} layers:"]
    for rank, (seat, cost, cap) in enumerate(zip(seats, costs, caps)):
        one = min(cost.need(i, i + 1, length) for i in range(model.num_layers))
        detail = (f"at most {cap} layer(s)" if cap >= 1 else
                  f"not even one layer: it needs {_gb(one)}, short by {_gb(one - cost.allowed)}")
        lines.append(f"  {_stage_line(rank, seat, cost, request)}: {detail}")
    missing = model.num_layers - sum(caps)
    if missing <= 0:  # enough room by count, but not in the order the layers come
        largest = max(model.layer_bytes(i, costs[0].element_bytes) for i in range(model.num_layers))
        lines.append(f"  no split into contiguous slices fits them: the layers differ in size (largest layer "
                     f"{_gb(largest)}) and each stage's slice must fit it whole")
    else:
        # The widest layer with its share of one sequence's KV, on the seat where it costs the most.
        def widest(c: _Cost) -> tuple[int, int]:
            return max((c.layers.layer_bytes(i, i + 1, c.element_bytes), c.kv_bytes(i, i + 1, length))
                       for i in range(model.num_layers))

        weights, kv = max((widest(c) for c in costs), key=sum)
        lines.append(f"  short by about {_gb(missing * (weights + kv) / (1 - HEADROOM_FRACTION))} for the other "
                     f"{missing} layer(s) (up to {_gb(weights)} of weights + {_gb(kv)} of KV each)")
    lines.append("ways out: " + _ways_out(model, seats, request, replica))
    return "\n".join(lines)


def _fits(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest, layers: _Layers) -> bool:
    return _greedy(_costs(model, seats, request, layers), model.num_layers, request.max_model_len) is not None


def largest_max_model_len(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest) -> int:
    """The longest ``--max-model-len`` these stages fit (0: not even one token beside the weights)."""
    layers = _Layers(model)
    low, high = 0, request.max_model_len
    while low < high:
        middle = (low + high + 1) // 2
        if _fits(model, seats, _with(request, max_model_len=middle), layers):
            low = middle
        else:
            high = middle - 1
    return low


def _with(request: PlanRequest, **changes: Any) -> PlanRequest:
    return replace(request, layer_split=None, **changes)


def _ways_out(model: ModelFacts, seats: Sequence[StageSeat], request: PlanRequest, replica: int) -> str:
    ways = []
    layers = _Layers(model)
    longest = largest_max_model_len(model, seats, request)
    if longest >= 1:
        ways.append(f"lower --max-model-len to {longest} or less")
    # A stage that cannot hold even one layer only helps when left out.
    useless = [s for s in seats if _cost(layers, s, request, first=False, last=False).most_layers(
        model.num_layers, request.max_model_len) < 1]
    kept = [s for s in seats if s not in useless] or [max(seats, key=lambda s: s.memory.usable_bytes())]
    if useless:
        names = ", ".join(sorted({s.label for s in useless}))
        ways.append(f"leave {names} out (give it no '{MLX_RESOURCE}' unit): it cannot hold even one layer")
    biggest = max(kept, key=lambda s: s.memory.budget(request.memory_fraction, 1).budget_bytes)
    for extra in range(0 if useless else 1, min(_MAX_EXTRA_NODES, model.num_layers - len(kept)) + 1):
        grown = [*kept[:-1], *[StageSeat(f"new-{i}", "?", biggest.memory, 1, f"new node {i + 1}")
                               for i in range(extra)], kept[-1]]
        if _fits(model, grown, request, layers):
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
    lines += kv_cache_lines(plan)
    drafts = [s for stages in plan.replicas for s in stages if s.draft_bytes]
    if drafts:
        lines.append(f"each replica's rank 0 also holds the draft model: {drafts[0].draft_bytes / _GB:.2f} GB "
                     "(its weights and KV for the sequences that may speculate), counted before its KV")
    lines.append(f"layers chosen by the {plan.chosen_by}; each stage keeps {HEADROOM_FRACTION:.0%} of its budget "
                 f"as headroom beyond weights, one full sequence and {RUNTIME_OVERHEAD_BYTES / _GB:.2f} GB of runtime")
    return "\n".join(lines)


def kv_cache_lines(plan: MemoryPlan) -> list[str]:
    """The plan's --kv-cache-dtype beside the KV tokens it holds and, quantized, the context that buys against
    auto on the same seats (pure): one line, naming each replica where replicas differ."""
    kv = plan.request.kv_cache_dtype
    if kv.quantized:
        name = f"KV cache: {kv.name} ({kv.bits}-bit, group {kv.group_size})"
    else:
        dtypes = sorted({s.dtype for stages in plan.replicas for s in stages})
        name = f"KV cache: auto (keys and values in {', '.join(dtypes) or 'the compute dtype'})"
    figures = []
    for index in range(len(plan.replicas)):
        figure = f"{plan.replica_kv_tokens(index):,} tokens"
        gain = plan.kv_gain(index)
        if gain is not None:
            figure += f", {gain:.2f}x of auto ({plan.auto_kv_tokens[index]:,} tokens)"
        elif plan.auto_kv_tokens:
            figure += " (auto does not fit these stages)"
        figures.append(figure)
    if len(set(figures)) == 1:
        return [f"{name}: {figures[0]}" + (" per replica" if len(figures) > 1 else "")]
    return [f"{name}: " + "; ".join(f"replica {i} {figure}" for i, figure in enumerate(figures))]
