"""A tensor-parallel group member's life: compute every batch its worker 0 mirrors, until SHUTDOWN.

A member (worker 1.. of a stage's group, ``stage_worker.transport.group``) holds its share of the stage's
layers and nothing else: no embedding, no head, no sampling, no neighbours. Worker 0 sends it each batch's
records and input rows before computing them itself; the member runs the same records through its share
(``StageCompute.forward``: the same KV bookkeeping, prefix-cache records and rollbacks as worker 0), whose
all-reduces pair with worker 0's, and releases what the batch releases. Nothing goes back: worker 0 has the
group's sum.
"""

from __future__ import annotations

import time

import mlx.core as mx

from stage_worker.engine.stage_runtime import BatchTimer, StageCompute
from stage_worker.transport import wire
from stage_worker.transport.links import InboundLink
from stage_worker.transport.wire import FrameKind


def member_loop(compute: StageCompute, inbound: InboundLink, on_batch: BatchTimer | None = None) -> None:
    """Compute each mirrored batch; return after SHUTDOWN."""
    model = compute.model

    def check(header: wire.FrameHeader) -> None:
        if header.kind == FrameKind.FORWARD:
            wire.check_forward_header(header, hidden_size=model.hidden_size, wire_dtype=model.dtype,
                                      sender=inbound.peer_name)

    while True:
        waited = time.perf_counter()
        message = inbound.recv(check=check)
        if message.kind == FrameKind.SHUTDOWN:
            return
        if message.kind != FrameKind.FORWARD:
            raise wire.WireMismatchError(f"{inbound.peer_name} sent unexpected {message.kind.name}")
        started = time.perf_counter()
        hidden = message.payload if message.payload is not None else \
            mx.zeros((0, model.hidden_size), dtype=model.dtype)
        out = compute.forward(message.records, hidden, message.header.in_flight)
        compute.release_finished(message.records)
        if on_batch is not None:
            on_batch(int(out.shape[0]), time.perf_counter() - started, started - waited, 0.0)
