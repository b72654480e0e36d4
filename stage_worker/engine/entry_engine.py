"""The entry stage's engine: requests in from gRPC threads, batches through the pipeline.

gRPC handlers call ``submit`` / ``abort`` (from any thread) and read events
from the returned ``RequestHandle``; the engine loop runs on the thread that
loaded the model (MLX streams are per thread) and is the only one touching the
pipeline. Every event reaches its handle's queue through one place,
``_deliver``, which then calls the ``on_delivered`` hook once with the ids of
the requests that got events: a reader on an event loop (the stage's aio gRPC
server) wakes once per step for all its streams instead of parking a thread
per stream on its queue.
When there is no work the loop sleeps on a condition variable, never spinning.
A pipeline failure fails every request at once with the reason and ends the
loop with ``PipelineBroken`` so the process can exit and be replaced.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from stage_worker.engine.scheduler import (
    Batch,
    Finish,
    GenerationRequest,
    QueueFullError,
    RequestError,
    RequestEvent,
    Scheduler,
)
from stage_worker.engine.stage_runtime import EntryPipeline
from stage_worker.engine.stage_status import StageStatus
from stage_worker.transport import wire
from stage_worker.transport.links import LinkError
from stagemesh_core import settings
from stagemesh_core.states import StageState

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


def step_ahead_wanted(setting: str, backend: str) -> bool:
    """``STAGEMESH_STEP_AHEAD`` (auto, on, off) on ``backend`` (pure): auto follows ``step_ahead_pays``."""
    return settings.switched_on(setting, auto=step_ahead_pays(backend))


def step_ahead_pays(backend: str) -> bool:
    """Whether a single-stage pipeline should queue each decode step before reading the last (pure).

    It overlaps the host's work (building the next step, reading tokens back, delivering them) with
    the device's, so it pays where the device is not the host's own cores; on the CPU backend the step
    and the host's work compete for the same cores (docs/performance.md, "The knobs").
    """
    return backend != "cpu"


def continue_oldest(in_flight: int, micro_batches: int, has_work: bool, single_stage: bool) -> bool:
    """Whether the engine should queue the oldest batch's continuation before reading its tokens (pure).

    A single stage, or a pipeline run without micro-batches, has nothing else to overlap its host
    work with: always, once its micro-batch slots are taken or nothing new waits for one. A pipeline
    with micro-batches overlaps its stages with them already; a continuation only pays where a stage
    would otherwise wait for the others: fewer batches in flight than slots, and no new work to fill
    one. With every slot full a continuation is no faster and makes part of each wave's first token
    later (docs/performance.md, "What did not pay").
    """
    if in_flight == 0:
        return False
    if single_stage or micro_batches == 1:
        return in_flight >= micro_batches or not has_work
    return in_flight < micro_batches and not has_work


class PipelineBroken(RuntimeError):
    """A neighbour failed; this process must exit so the replica is rebuilt."""


class NotAccepting(RuntimeError):
    """The stage is draining, stopping or failed; the caller answers UNAVAILABLE."""


@dataclass(frozen=True)
class RequestFailed:
    message: str


class RequestHandle:
    """A request's event stream: ``RequestEvent`` items, or a final ``RequestFailed``. The queue is
    the one channel of a request's events; ``on_delivered`` only says that something arrived."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.events: queue.SimpleQueue[RequestEvent | RequestFailed] = queue.SimpleQueue()


class EntryEngine:
    def __init__(
        self, pipeline: EntryPipeline, scheduler: Scheduler, status: StageStatus, micro_batches: int = 1,
        step_ahead: bool = False, on_delivered: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._step_ahead = step_ahead
        self._micro_batches = max(1, micro_batches)
        self.micro_batches = self._micro_batches
        self._scheduler = scheduler
        self._status = status
        self._cond = threading.Condition()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = False
        self._accepting = True
        self._on_delivered = on_delivered

    @property
    def steps_ahead(self) -> bool:
        """Decode steps are queued before the tokens they continue from are read (see ``run``)."""
        return self._step_ahead and self._pipeline.can_carry

    # -- called from gRPC threads ------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises RequestError, QueueFullError or NotAccepting."""
        with self._cond:
            if not self._accepting:
                raise NotAccepting(f"the entry stage is {self._status.state.value}, not accepting requests")
            self._scheduler.add(request)
            handle = RequestHandle(request.request_id)
            self._handles[request.request_id] = handle
            self._publish_load()
            self._cond.notify()
        return handle

    def abort(self, request_id: str) -> bool:
        with self._cond:
            event = self._scheduler.abort(request_id)
            if event is None:
                return False
            handle = self._handles.pop(request_id, None)
            self._publish_load()
            self._cond.notify()
        if handle is not None:
            self._deliver([(handle, event)])
        return True

    def drain(self) -> tuple[int, int]:
        with self._cond:
            self._accepting = False
            self._status.set_state(StageState.DRAINING)
            return self._scheduler.num_running, self._scheduler.num_waiting

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._accepting = False
            self._cond.notify()

    # -- the loop, on the model's thread --------------------------------------
    def run(self) -> None:
        """Serve until ``stop``; then abort what is left and stop the pipeline cleanly.

        Keeps up to ``micro_batches`` batches in flight: while there is room and
        work, it submits (stage 0 computes its part and hands it on); otherwise
        it collects the oldest batch's tokens.

        With ``step_ahead`` (``step_ahead_pays``) and a pipeline that can
        carry (``EntryPipeline.can_carry``), it also submits the oldest
        batch's continuation (the next decode step of its sequences, fed the
        tokens that batch is about to sample, plus any new work) before
        reading that batch's tokens, when ``continue_oldest`` says so. On a
        single stage the continuation runs on the device at once, so building
        a step's graph, reading tokens back and delivering them overlap the
        device's compute, as ``mlx_lm.generate_step`` does for one sequence;
        on a longer pipeline it is built and announced while the other stages
        compute, and runs as soon as the tokens are back.
        """
        in_flight: deque[Batch] = deque()
        continuous = self.steps_ahead
        try:
            while True:
                with self._cond:
                    while not self._stopping and not in_flight and not self._scheduler.has_work():
                        self._cond.wait(_IDLE_WAIT_S)
                    if self._stopping:
                        break
                    batch = None
                    collect_after = False
                    if continuous and continue_oldest(len(in_flight), self._micro_batches,
                                                      self._scheduler.has_work(), self._pipeline.single_stage):
                        batch = self._scheduler.continuation(in_flight[0])
                        if self._scheduler.has_work():
                            batch = Batch(batch.chunks + self._scheduler.next_batch(self._micro_batches).chunks)
                        self._publish_load()
                        collect_after = True
                    elif len(in_flight) < self._micro_batches and self._scheduler.has_work():
                        batch = self._scheduler.next_batch(self._micro_batches)
                        self._publish_load()
                if batch is not None and batch.chunks:
                    self._pipeline.submit(batch.chunks)
                    in_flight.append(batch)
                    if not collect_after:
                        continue
                if not in_flight:
                    continue
                sampled = self._pipeline.collect()
                done = in_flight.popleft()
                with self._cond:
                    events = self._scheduler.on_sampled(done, sampled)
                    handles = [(self._handles.get(e.request_id), e) for e in events]
                    for event in events:
                        if event.finish is not None:
                            self._handles.pop(event.request_id, None)
                    self._publish_load()
                self._deliver([(handle, event) for handle, event in handles if handle is not None])
        except (LinkError, wire.WireMismatchError) as exc:
            self._fail_all(f"the pipeline failed: {exc}")
            raise PipelineBroken(str(exc)) from exc
        except Exception as exc:
            # A fault of the stage itself (a bug, the device): every waiting request must hear it now, or its
            # gRPC stream would wait on an engine that has stopped; the stage then exits and is restarted.
            self._fail_all(f"the entry stage failed: {type(exc).__name__}: {exc}")
            raise
        self._finish_all_aborted()
        self._pipeline.shutdown()

    def _publish_load(self) -> None:
        s = self._scheduler
        self._status.set_load(s.num_running, s.num_waiting, s.finished_count, s.generated_count)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            self._accepting = False
            self._scheduler.fail_all()
            handles, self._handles = list(self._handles.values()), {}
        self._status.set_state(StageState.FAILED, message)
        self._deliver([(handle, RequestFailed(message)) for handle in handles])

    def _finish_all_aborted(self) -> None:
        with self._cond:
            self._scheduler.fail_all()
            handles, self._handles = list(self._handles.values()), {}
        self._deliver([(handle, RequestEvent(handle.request_id, (), Finish.ABORT, 0, 0)) for handle in handles])

    def _deliver(self, events: list[tuple[RequestHandle, RequestEvent | RequestFailed]]) -> None:
        """Queue each event on its handle, then tell ``on_delivered`` once which requests got one."""
        for handle, event in events:
            handle.events.put(event)
        if events and self._on_delivered is not None:
            self._on_delivered([handle.request_id for handle, _ in events])


__all__ = ["EntryEngine", "NotAccepting", "PipelineBroken", "QueueFullError", "RequestError", "RequestFailed",
           "RequestHandle", "continue_oldest", "step_ahead_pays", "step_ahead_wanted"]
