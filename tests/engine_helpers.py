"""Shared by the engine tests that drive a real ``EntryEngine``: a counting pipeline and the reader of results,
and the weights as a stage on this machine serves them."""

from __future__ import annotations

from typing import TypeVar

from stage_worker.engine.entry_engine import RequestFailed, RequestHandle
from stage_worker.engine.scheduler import Finish
from stage_worker.engine.stage_runtime import EntryPipeline

Model = TypeVar("Model")


def as_served(model: Model) -> Model:
    """``model`` (a loaded ``StageModel``) with the weights a stage on this machine would run: dense where
    ``--dequantize auto`` makes them dense (the CPU with an optimized BLAS, which tests/conftest.py loads into
    this process; quantized on the CPU the default model's forward is some twenty times slower)."""
    from stage_worker.model.blas import loaded_blas
    from stage_worker.model.device import current_backend
    from stage_worker.model.stage_model import choose_dense_weights

    dense, _ = choose_dense_weights("auto", backend=current_backend(), blas=loaded_blas(),
                                    quantized=model.quantized, dense_bytes=model.dense_bytes(),
                                    memory_budget=1 << 40)
    if dense:
        model.dequantize()
    return model


class CountingPipeline(EntryPipeline):
    """The real entry pipeline, counting the decode steps submitted before their input token was read."""

    carried = 0

    def submit(self, chunks):
        self.carried += sum(c.carried for c in chunks)
        return super().submit(chunks)


def read_until_finished(handles: list[RequestHandle], timeout_s: float = 120) -> tuple[list[list[int]], list[Finish]]:
    """Every request's tokens and finish reason, in the handles' order; a failure fails the test."""
    outputs, finishes = [], []
    for handle in handles:
        tokens: list[int] = []
        while True:
            event = handle.events.get(timeout=timeout_s)
            assert not isinstance(event, RequestFailed), event
            tokens += event.token_ids
            if event.finish is not None:
                outputs.append(tokens)
                finishes.append(event.finish)
                break
    return outputs, finishes


def read_with_logprobs(handles: list[RequestHandle], timeout_s: float = 120) -> list[tuple[list[int], list]]:
    """Every request's tokens and their logprobs (one per token where it asked for them), in the handles' order;
    a failure fails the test."""
    outputs = []
    for handle in handles:
        tokens: list[int] = []
        logprobs: list = []
        while True:
            event = handle.events.get(timeout=timeout_s)
            assert not isinstance(event, RequestFailed), event
            tokens += event.token_ids
            logprobs += event.logprobs
            if event.finish is not None:
                break
        outputs.append((tokens, logprobs))
    return outputs


def lane(name_in: str, name_out: str):
    """A real control lane over loopback, payloads on the lane: (inbound end, outbound end, the outbound end's
    watchdog, which its user closes with the lane)."""
    import socket
    import threading

    from stage_worker.transport.links import InboundLink, OutboundLink, RingWatchdog

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inbound = InboundLink(None, 0, name_in)
    inbound.listen("127.0.0.1", port)
    accepted = threading.Thread(target=inbound.accept, args=(10, lambda body: None))
    accepted.start()
    outbound = OutboundLink(None, 1, name_out)
    outbound.connect("127.0.0.1", port, 10)
    outbound.handshake({"hello": 1}, 10)
    accepted.join()
    inbound.attach_lane_payloads()
    outbound.attach_lane_payloads(watchdog := RingWatchdog(120, name_out))
    return inbound, outbound, watchdog


class InProcessPipeline:
    """A real pipeline of ``stages`` (``StageModel``s, first to last) in this process: the entry engine and
    scheduler on one thread, every other stage's relay loop on its own, hidden states over real lanes."""

    def __init__(self, stages, *, max_num_seqs: int = 8, prefix_cache=None, max_batch_tokens: int = 512,
                 prefill_chunk_tokens: int | None = None, speculative=None, proposer=None,
                 launcher: bool = False) -> None:
        import threading

        from stage_worker.engine.entry_engine import EntryEngine
        from stage_worker.engine.scheduler import Scheduler
        from stage_worker.engine.stage_runtime import StageCompute, relay_loop
        from stage_worker.engine.stage_status import StageStatus

        depth = len(stages)
        # lanes[g]: from stage g to stage g+1 (the last one wraps round to the entry stage)
        self._lanes = [lane(f"stage {g}", f"stage {(g + 1) % depth}") for g in range(depth)] if depth > 1 else []
        self._relays = [threading.Thread(target=relay_loop, daemon=True,
                                         args=(StageCompute(stages[g], max_num_seqs), self._lanes[g - 1][0],
                                               self._lanes[g][1], g == depth - 1),
                                         kwargs={"build_ahead": True}) for g in range(1, depth)]
        for relay in self._relays:
            relay.start()
        entry = StageCompute(stages[0], max_num_seqs)
        if depth == 1:
            from stage_worker.engine.launcher import KernelLauncher

            pipeline = EntryPipeline(entry, None, None, is_last=True, launcher=KernelLauncher() if launcher else None)
        else:
            pipeline = EntryPipeline(entry, self._lanes[0][1], self._lanes[-1][0], is_last=False, build_ahead=True)
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_model_len=512, max_waiting=64,
                                   max_batch_tokens=max_batch_tokens,
                                   prefill_chunk_tokens=prefill_chunk_tokens or max_batch_tokens,
                                   prefix_cache=prefix_cache, speculative=speculative, proposer=proposer)
        self.engine = EntryEngine(pipeline, self.scheduler, StageStatus(), micro_batches=1, step_ahead=True)
        self._runner = threading.Thread(target=self.engine.run, daemon=True)
        self._runner.start()
        self._count = 0

    def submit(self, prompt, max_tokens: int, sampling=None, stop_token_ids=frozenset()) -> RequestHandle:
        """A request (greedy unless ``sampling`` says otherwise; ignoring EOS unless ``stop_token_ids`` are given)."""
        from stage_worker.engine.scheduler import GenerationRequest
        from stagemesh_core.sampling import GREEDY

        self._count += 1
        return self.engine.submit(GenerationRequest(f"r{self._count}", tuple(prompt), max_tokens, sampling or GREEDY,
                                                    frozenset(stop_token_ids), ignore_eos=not stop_token_ids))

    def generate(self, prompt, max_tokens: int) -> list[int]:
        return read_until_finished([self.submit(prompt, max_tokens)])[0][0]

    def close(self) -> None:
        self.engine.stop()
        self._runner.join(60)
        for relay in self._relays:
            relay.join(60)  # the engine's shutdown sends SHUTDOWN round the ring
        for inbound, outbound, watchdog in self._lanes:
            inbound.close()
            outbound.close()
            watchdog.close()
        assert not self._runner.is_alive() and not any(relay.is_alive() for relay in self._relays)

    def __enter__(self) -> InProcessPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
