"""A tensor-parallel stage's group: its MLX group for the all-reduces, and the mirror lanes that keep it in step.

With ``-tp T`` a stage is T worker processes. Worker 0 is the stage as its neighbours know it (their lanes,
the entry stage's gRPC); workers 1.. (members) talk to no other stage. Two things join a group:

* **The mirror lanes.** Worker 0 connects a lane (``OutboundLink``, the wire format of the hops) to each
  member and handshakes (``GroupIdentity``, checked by the pure ``check_leader``); before computing a batch it
  sends the member that batch's records and input rows (``GroupMirror.send``), so every member runs the same
  batch at the same positions (the same graph, the same all-reduces in the same order) and the group never
  diverges. SHUTDOWN ends the members. A member that dies closes its lane: ``GroupMirror.watch`` learns at
  once, where an MLX group would hang in its next all-reduce.
* **The MLX group** (``join_group``): the backend's environment from the plan (``group_environment``, pure:
  the ring's hostfile, nccl's and jaccl's rendezvous at worker 0's group port), then
  ``mx.distributed.init(strict=True)`` under the ring watchdog. A process joins one MLX group, which is why a
  tensor-parallel pipeline carries hidden states between stages on the lane, never MLX's ring.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from stage_worker.batch import SequenceRecord
from stage_worker.transport import wire
from stage_worker.transport.links import InboundLink, LinkError, OutboundLink, RingWatchdog
from stagemesh_core.plan import PipelinePlan


@dataclass(frozen=True)
class GroupIdentity:
    """What worker 0 tells each member in the handshake; both must agree."""

    replica: int
    rank: int
    member: int  # the member the lane is meant for
    size: int
    layers: tuple[int, int]
    fingerprint: str
    hidden_size: int
    wire_dtype: str
    backend: str

    def to_body(self) -> dict[str, Any]:
        return {"protocol": wire.PROTOCOL_VERSION, **asdict(self), "layers": list(self.layers)}


def check_leader(me: GroupIdentity, body: dict[str, Any]) -> str | None:
    """Pure handshake rule: why the worker 0 that sent ``body`` is not this member's (None if it is)."""
    if body.get("protocol") != wire.PROTOCOL_VERSION:
        return f"wire protocol v{body.get('protocol')} != v{wire.PROTOCOL_VERSION}; run one stagemesh version"
    if (body.get("replica"), body.get("rank")) != (me.replica, me.rank):
        return (f"peer is worker 0 of replica {body.get('replica')} stage {body.get('rank')}, this member "
                f"belongs to replica {me.replica} stage {me.rank}")
    if body.get("member") != me.member or body.get("size") != me.size:
        return (f"peer expects member {body.get('member')} of a group of {body.get('size')}, this is member "
                f"{me.member} of {me.size}; start every worker from the same plan (-tp)")
    if body.get("fingerprint") != me.fingerprint or list(body.get("layers", ())) != list(me.layers):
        return "peer loaded a different model or layer range"
    if body.get("hidden_size") != me.hidden_size or body.get("wire_dtype") != me.wire_dtype:
        return (f"peer sends hidden size {body.get('hidden_size')} in {body.get('wire_dtype')}, this member "
                f"takes {me.hidden_size} in {me.wire_dtype}; give every worker the same --dtype")
    if body.get("backend") != me.backend:
        return f"peer computes over {body.get('backend')}, this member over {me.backend} (--tp-backend)"
    return None


def group_environment(plan: PipelinePlan, rank: int, member: int, hostfile: str) -> dict[str, str]:
    """The environment MLX's ``plan.tp_backend`` reads to join stage ``rank``'s group as ``member`` (pure).
    ``hostfile`` is where the ring's hostfile (``plan.group_hostfile``) is written."""
    group = plan.group(rank)
    leader = group[0]
    env = {"MLX_RANK": str(member), "MLX_WORLD_SIZE": str(len(group))}
    if plan.tp_backend == "ring":
        env["MLX_HOSTFILE"] = hostfile
    elif plan.tp_backend == "nccl":
        env["NCCL_HOST_IP"], env["NCCL_PORT"] = leader.host, str(leader.group_port)
    else:  # jaccl: the RDMA devices come from the node (MLX_IBV_DEVICES, written by mlx.distributed_config)
        env["MLX_JACCL_COORDINATOR"] = f"{leader.host}:{leader.group_port}"
    return env


def join_group(plan: PipelinePlan, rank: int, member: int, watchdog: RingWatchdog) -> mx.distributed.Group:
    """Join stage ``rank``'s tensor-parallel group as ``member`` over ``plan.tp_backend``; checks its shape."""
    if plan.tp_backend == "jaccl" and not os.environ.get("MLX_IBV_DEVICES"):
        raise LinkError("--tp-backend jaccl needs MLX_IBV_DEVICES on every node of the group (the RDMA device "
                        "file `mlx.distributed_config --backend jaccl` writes); set it or use --tp-backend ring")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"stagemesh-group-{rank}-{member}-",
                                     delete=False) as f:
        json.dump(plan.group_hostfile(rank), f)
        hostfile = f.name
    os.environ.update(group_environment(plan, rank, member, hostfile))
    peers = ", ".join(f"{w.host}:{w.group_port}" for w in plan.group(rank))
    try:
        with watchdog.guard(f"joining the tensor-parallel group ({plan.tp_backend}: {peers})"):
            group = mx.distributed.init(backend=plan.tp_backend, strict=True)
    except RuntimeError as exc:
        raise LinkError(f"could not join stage {rank}'s tensor-parallel group over {plan.tp_backend} ({peers}): "
                        f"{exc}") from exc
    finally:
        os.unlink(hostfile)
    if group.size() != plan.tensor_parallel_size or group.rank() != member:
        raise LinkError(f"the tensor-parallel group formed with size {group.size()} rank {group.rank()}, expected "
                        f"size {plan.tensor_parallel_size} rank {member} ({peers})")
    return group


def group_minimum(value: int, group: mx.distributed.Group) -> int:
    """The smallest ``value`` any member holds (a collective: every member calls it at the same point)."""
    gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group)
    return int(np.asarray(gathered).min())


class GroupMirror:
    """Worker 0's lanes to its members: every batch goes to them before worker 0 computes it."""

    def __init__(self, links: Sequence[OutboundLink]) -> None:
        self._links = list(links)
        self._closing = threading.Event()

    @classmethod
    def connect(cls, plan: PipelinePlan, rank: int, identity: GroupIdentity, deadline_s: float,
                watchdog: RingWatchdog) -> GroupMirror:
        """Connect and handshake a lane to every member of stage ``rank``'s group."""
        links: list[OutboundLink] = []
        try:
            for member in plan.group(rank)[1:]:
                link = OutboundLink(None, member.member, member.name)
                links.append(link)
                link.connect(member.host, member.lane_port, deadline_s)
                link.handshake({**identity.to_body(), "member": member.member}, deadline_s)
                link.attach_lane_payloads(watchdog)
        except BaseException:
            for link in links:
                link.close()
            raise
        return cls(links)

    def send(self, records: Sequence[SequenceRecord], hidden: mx.array, in_flight: int) -> None:
        """A batch's records and input rows (``[T, hidden]``, evaluated here) to every member."""
        for link in self._links:  # zero rows too (releases only): the header still says the width and dtype
            link.send(wire.FrameKind.FORWARD, records, hidden, in_flight=in_flight)

    def shutdown(self) -> None:
        """SHUTDOWN to every member still reachable (one that already left needs none)."""
        self._closing.set()
        for link in self._links:
            with contextlib.suppress(LinkError):
                link.send(wire.FrameKind.SHUTDOWN)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(member name)`` from a thread of its own when a member's lane closes before
        ``shutdown`` or ``close``: the member died, and the group's next all-reduce would never finish."""
        for link in self._links:
            def wait(link: OutboundLink = link) -> None:
                link.wait_peer_gone()
                if not self._closing.is_set():
                    on_lost(link.peer_name)

            threading.Thread(target=wait, name=f"group-watch-{link.peer_name}", daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        for link in self._links:
            link.close()


def accept_leader(host: str, lane_port: int, identity: GroupIdentity, deadline_s: float) -> InboundLink:
    """A member's lane from its worker 0, handshake checked (``check_leader``)."""
    inbound = InboundLink(None, 0, f"stage {identity.rank} worker 0")
    inbound.listen(host, lane_port)
    try:
        inbound.accept(deadline_s, lambda body: check_leader(identity, body))
    except BaseException:
        inbound.close()
        raise
    inbound.attach_lane_payloads()
    return inbound
