"""Joining the pipeline: the handshake with both neighbours, then MLX's ring.

Each stage sends its ``StageIdentity`` to its successor over the control
lane; the successor checks it with ``check_predecessor`` (a pure rule) and
refuses a predecessor that does not fit, naming why; the refusal reaches both
sides. Only then does the stage join MLX's ring (``init_ring``), whose
messages carry no tags: a mismatch found after that point would deadlock
instead of failing.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from stage_worker.transport import wire
from stage_worker.transport.links import InboundLink, LinkError, OutboundLink, RingWatchdog
from stagemesh_core.plan import PipelinePlan, StagePlacement


@dataclass(frozen=True)
class StageIdentity:
    """What a stage tells its neighbour in the handshake; both sides must agree."""

    rank: int
    world: int
    replica: int
    layers: tuple[int, int]
    num_layers: int
    hidden_size: int
    wire_dtype: str
    fingerprint: str
    hop_transport: str = "lane"

    def to_body(self) -> dict[str, Any]:
        return {"protocol": wire.PROTOCOL_VERSION, **self.__dict__, "layers": list(self.layers)}


def check_predecessor(me: StageIdentity, body: dict[str, Any]) -> str | None:
    """Pure handshake rule: why the stage that sent ``body`` cannot feed ``me`` (None if it can)."""
    expected_rank = (me.rank - 1) % me.world
    if body.get("protocol") != wire.PROTOCOL_VERSION:
        return f"wire protocol v{body.get('protocol')} != v{wire.PROTOCOL_VERSION}; run one stagemesh version"
    if body.get("world") != me.world or body.get("replica") != me.replica:
        return (f"peer belongs to a pipeline of {body.get('world')} stages (replica "
                f"{body.get('replica')}), this stage to {me.world} (replica {me.replica})")
    if body.get("rank") != expected_rank:
        return f"peer is rank {body.get('rank')}, expected rank {expected_rank} before rank {me.rank}"
    if body.get("fingerprint") != me.fingerprint:
        return "peer loaded a different model (architecture or shapes differ)"
    if body.get("hidden_size") != me.hidden_size or body.get("wire_dtype") != me.wire_dtype:
        return (f"peer sends hidden size {body.get('hidden_size')} in {body.get('wire_dtype')}, "
                f"this stage takes {me.hidden_size} in {me.wire_dtype}; give every stage the same --dtype")
    if body.get("hop_transport", "ring") != me.hop_transport:
        return (f"peer sends hidden states over the {body.get('hop_transport', 'ring')}, this stage expects "
                f"the {me.hop_transport}; start every stage from the same plan (--hop-transport)")
    peer_end = body.get("layers", [None, None])[1]
    my_start = me.layers[0] if me.rank != 0 else me.num_layers
    if peer_end != my_start:
        return (f"peer's layers end at {peer_end} but this stage starts at {my_start}: "
                f"the layer split has a gap or overlap")
    return None


def connect_neighbours(
    plan: PipelinePlan, me: StagePlacement, identity: StageIdentity, deadline_s: float
) -> tuple[InboundLink, OutboundLink]:
    """Open our lane, connect to the successor's, and handshake both ways concurrently.

    Accepting runs on a thread because every stage both accepts and connects:
    done in sequence, the ring of handshakes would wait on itself.
    """
    prev_rank = (me.rank - 1) % plan.size
    next_stage = plan.stages[(me.rank + 1) % plan.size]
    inbound = InboundLink(None, prev_rank, f"stage {prev_rank} ({plan.stages[prev_rank].host})")
    outbound = OutboundLink(None, next_stage.rank, f"stage {next_stage.rank} ({next_stage.host})")
    inbound.listen(me.host, me.lane_port)
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            inbound.accept(deadline_s, lambda body: check_predecessor(identity, body))
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    acceptor = threading.Thread(target=accept, name="lane-accept", daemon=True)
    acceptor.start()
    outbound.connect(next_stage.host, next_stage.lane_port, deadline_s)
    outbound.handshake(identity.to_body(), deadline_s)
    acceptor.join()
    if errors:
        raise errors[0]
    return inbound, outbound


def init_ring(plan: PipelinePlan, rank: int, watchdog: RingWatchdog) -> mx.distributed.Group:
    """Join MLX's ring as ``rank`` (``MLX_RANK`` / ``MLX_HOSTFILE`` from the plan) and check its shape."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"stagemesh-ring-{rank}-", delete=False) as f:
        json.dump(plan.ring_hostfile(), f)
        hostfile = f.name
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = hostfile
    try:
        with watchdog.guard("ring init"):
            group = mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(hostfile)
    if group.size() != plan.size or group.rank() != rank:
        raise LinkError(
            f"MLX ring formed with size {group.size()} rank {group.rank()}, expected size "
            f"{plan.size} rank {rank}: check MLX_RANK/MLX_HOSTFILE and that every host in the "
            f"hostfile is reachable"
        )
    return group
