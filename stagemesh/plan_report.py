"""The layer plan as ``stagemesh plan`` and ``stagemesh serve --dry-run`` print it.

Contract: ``print_plan(config, as_json, assume)`` plans a ``MeshConfig`` for the cluster this machine sees
(``coordinator.plan_preview``: each node's facts read on that node) or for the nodes ``--assume-node``
describes (``assumed_nodes``), prints one row per stage (or the JSON) and returns the exit code: 2 when the
plan cannot fit, with the numbers and the ways out. It starts no stage. At ``-tp`` above 1 it also states the
group's all-reduce cost per token and whether ``-tp`` over the link is expected to beat ``-pp``
(``tp_comparison``; the link's figures from ``tp_link_figures``: ``--tp-link FILE`` measured by
``stagemesh doctor --tp-link``, ``--tp-link-latency-us`` given, else the backend's named assumption).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from coordinator.layer_planner import MemoryPlan, format_plan
from coordinator.placement import PlacementError
from coordinator.plan_preview import assumed_preview, preview
from coordinator.ray_cluster import RayStartError
from stagemesh_core.errors import UserError
from stagemesh_core.memory import ModelFacts, NodeMemory, dtype_bytes
from stagemesh_core.settings import parse_size
from stagemesh_core.tp_cost import (
    GroupStage,
    LinkFigures,
    TpComparison,
    allreduces_per_layer,
    assumed_link,
    compare_tp_pp,
    format_comparison,
    given_link,
    link_from_doctor,
    published_bandwidth,
)


def assumed_nodes(specs: list[str]) -> list[tuple[str, NodeMemory]]:
    """The nodes ``--assume-node`` values describe (what-if planning: nothing is asked of any node)."""
    nodes: list[tuple[str, NodeMemory]] = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        size, _, backend = rest.partition(":")
        backend = backend or "metal"
        try:
            total = parse_size(size)
        except ValueError as exc:
            raise UserError(f"--assume-node {spec!r}: {exc}") from None
        if not name or backend not in ("metal", "cpu", "cuda"):
            raise UserError(f"--assume-node {spec!r}: write NAME=SIZE[:BACKEND], e.g. mac-mini=16GB:metal")
        if name in {n for n, _ in nodes}:
            raise UserError(f"--assume-node {spec!r}: {name} is described twice; give each node its own name")
        device = None if backend == "cpu" else total
        nodes.append((name, NodeMemory(backend, "assumed", total, total, device, device)))
    return nodes


def tp_link_for(args: Any, tensor_parallel_size: int, backend: str) -> LinkFigures:
    """The link the flags of ``add_tp_link_arguments`` name (``tp_link_figures``); ``UserError`` where they are
    given without a -tp group."""
    link_file, latency_us = getattr(args, "tp_link", None), getattr(args, "tp_link_latency_us", None)
    if tensor_parallel_size == 1 and (link_file or latency_us is not None):
        raise UserError("--tp-link and --tp-link-latency-us describe a -tp group's link: plan with -tp 2 or more")
    return tp_link_figures(backend, link_file, latency_us)


def tp_link_figures(backend: str, link_file: str | None = None, latency_us: float | None = None) -> LinkFigures:
    """The link ``-tp`` plans with: measured (``--tp-link FILE``, doctor's JSON), given
    (``--tp-link-latency-us``), else ``backend``'s named assumption; ``UserError`` for a file that holds no
    measurement of ``backend``, or for both flags at once."""
    if link_file and latency_us is not None:
        raise UserError("--tp-link and --tp-link-latency-us both give the all-reduce latency: pass one")
    if latency_us is not None:
        return given_link(backend, latency_us)
    if not link_file:
        return assumed_link(backend)
    try:
        with open(link_file) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tp-link {link_file}: {exc}; write it with `stagemesh doctor --tp-link --json > "
                        f"{link_file}`") from None
    link = link_from_doctor(report, f"--tp-link {link_file}")
    if link.backend != backend:
        raise UserError(f"--tp-link {link_file} measured --tp-backend {link.backend}, the plan computes over "
                        f"{backend}: measure it with `stagemesh doctor --tp-link --tp-backend {backend} --json`")
    return link


def tp_comparison(plan: MemoryPlan, facts: ModelFacts, tp: int, link: LinkFigures, devices: Any,
                  one_node: Any, model_type: str | None = None) -> list[tuple[list[GroupStage], TpComparison]]:
    """Each replica's stages as ``-tp`` runs them and ``compare_tp_pp``'s answer (pure). ``facts`` is the whole
    model's (not a worker's share): a stage's weights read per token are its layers and, on the last stage,
    the head (decode reads one row of the embedding, not the matrix)."""
    per_layer = allreduces_per_layer(model_type)
    answers = []
    for r, stages in enumerate(plan.replicas):
        group = []
        for s in stages:
            last = s.rank == len(stages) - 1
            streamed = facts.slice_weight_bytes(s.layers.start, s.layers.end, first=False, last=last,
                                                element_bytes=dtype_bytes(s.dtype, s.backend))
            bandwidth = link.bandwidth_gbs or published_bandwidth(devices[r][s.rank])
            group.append(GroupStage(len(s.layers), streamed, bandwidth, one_node[r][s.rank], per_layer))
        answers.append((group, compare_tp_pp(group, tp, link)))
    return answers


def print_plan(config, as_json: bool, assume: list[str] | None = None, *, link: LinkFigures | None = None,
               spec: Any = None) -> int:
    """Plan ``config`` (a ``MeshConfig`` with the model's facts) for the cluster it sees, or for the nodes
    ``assume`` describes, and print it; the command's exit code. ``link``: the -tp group's link
    (``tp_link_figures``; None: the backend's assumption); ``spec``: the model's ``ModelSpec``, for its
    architecture and hidden size."""
    tp = config.tensor_parallel_size
    try:
        if assume:
            shown = assumed_preview(config, assumed_nodes(assume))
        else:
            shown = preview(config)
        answers = []
        if tp > 1:
            link = link or tp_link_figures(config.tp_backend)
            answers = tp_comparison(shown.plan, config.model_facts, tp, link, shown.devices, shown.one_node,
                                    getattr(spec, "model_type", None))
    except (PlacementError, RayStartError, UserError) as exc:
        print(f"stagemesh plan: error: {exc}", file=sys.stderr)
        return 2
    plan = shown.plan
    hidden = getattr(spec, "hidden_size", None)
    if as_json:
        body: dict[str, Any] = {"model": config.served_model_name, "num_layers": config.num_layers, **plan.to_json()}
        if answers and link is not None:
            body["tensor_parallel"] = {"tensor_parallel_size": tp, "backend": link.backend, "link": asdict(link),
                                       "hidden_size": hidden,
                                       "replicas": [{"replica": i, "stages": [asdict(g) for g in group],
                                                     **c.to_json()} for i, (group, c) in enumerate(answers)]}
        print(json.dumps(body, indent=2))
    else:
        groups = (f" -tp {tp} (each row is a stage's worker 0: every worker holds 1/{tp} of each layer's weights and "
                  "KV, worker 0 also the embedding and head)") if tp > 1 else ""
        print(f"model: {config.served_model_name} ({config.num_layers} layers), -pp {config.pipeline_parallel_size} "
              f"-dp {config.data_parallel_size}{groups}, --max-model-len {config.max_model_len}")
        print(format_plan(plan))
        if answers and link is not None:
            group, first = answers[0]
            dtype = plan.replicas[0][0].dtype
            print("\n".join(format_comparison(first, link, group, hidden, dtype)))
            for i, (_, c) in enumerate(answers[1:], start=1):
                if c.verdict != first.verdict:
                    print(f"replica {i}: expected {c.verdict} faster ({c.missing or 'its nodes differ'})")
    return 0
