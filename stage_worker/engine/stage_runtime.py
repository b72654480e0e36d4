"""What a stage does with each message: compute its layers, pass on, sample at the end.

``StageCompute`` is the per-batch work of any stage (embed on the first, own layers on all, norm + head +
sampling on the last), independent of transport. ``EntryPipeline`` is the first stage's view of the whole
pipeline: it turns a batch of token chunks into sampled tokens, sending hidden states down the ring and
waiting (in a lane read, not a spinning ring receive) for the token ids the last stage sends back.
``relay_loop`` is every other stage's life: receive, compute, send, until a SHUTDOWN has gone round the ring.

Messages are consumed strictly in the order they were sent; with one batch in flight the entry checks each
TOKENS reply against the batch it sent. A sequence's ``RowOptions`` (``stage_worker.batch``) ride the body of
the FORWARD frame that starts it, once, and live on the last stage until its RELEASE (``row_options``);
logprobs, and a VERIFY record's kept tokens (``stage_worker.speculation.rules``), come back in the TOKENS frame.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from stage_worker.batch import Chunk, RecordFlag, RowOptions, SampledToken, SequenceRecord, TokenLogprob
from stage_worker.cache.kv_store import KVStore
from stage_worker.engine.launcher import KernelLauncher, Launched
from stage_worker.model.blas import AdaptiveBlasThreads
from stage_worker.model.packed_forward import DecodeRows, Segment
from stage_worker.model.stage_model import StageModel
from stage_worker.sampling.row_options import LogprobRows, RowProcessors, logprobs_from_body, rows_body, rows_from_body
from stage_worker.sampling.sampler import sample_rows
from stage_worker.speculation.rules import VerifyLayout, accept_proposals, drafts_body, drafts_from_body
from stage_worker.transport import wire
from stage_worker.transport.build_ahead import Placeholder
from stage_worker.transport.group import GroupMirror
from stage_worker.transport.links import InboundLink, LinkError, OutboundLink
from stage_worker.transport.wire import FrameKind

log = logging.getLogger(__name__)

# (token rows, compute seconds, wait seconds, send seconds) of one batch
BatchTimer = Callable[[int, float, float, float], None]


@dataclass
class LogitRecorder:
    """Keeps the last stage's float32 logits of every sampled row (for parity checks)."""

    rows: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    def add(self, records: Sequence[SequenceRecord], logits: mx.array) -> None:
        values = np.array(logits, copy=True)
        for i, record in enumerate(records):
            self.rows.append((record.seq_id, record.start_pos + record.num_tokens, values[i]))

    def save(self, path: str) -> None:
        if not self.rows:
            np.savez(path, seq_ids=np.zeros(0, np.int64), positions=np.zeros(0, np.int64),
                     logits=np.zeros((0, 0), np.float32))
            return
        np.savez(
            path,
            seq_ids=np.array([r[0] for r in self.rows], dtype=np.int64),
            positions=np.array([r[1] for r in self.rows], dtype=np.int64),
            logits=np.stack([r[2] for r in self.rows]),
        )


class StageCompute:
    """One stage's computation on a batch, against its own KV caches."""

    def __init__(self, model: StageModel, max_sequences: int, recorder: LogitRecorder | None = None,
                 threads: AdaptiveBlasThreads | None = None):
        self.model = model
        self.kv = KVStore(model.new_caches, max_sequences)
        self._recorder = recorder
        self._threads = threads
        self.rows = RowProcessors(model.spec)  # per-sequence logits processors (used on the last stage)
        # A tensor-parallel stage's worker 0: each batch goes to the group's members before it is computed here
        # (``stage_worker.transport.group``), so their all-reduces pair with this stage's.
        self.mirror: GroupMirror | None = None

    @property
    def recording(self) -> bool:
        """Whether the last stage's logits are recorded (a parity run)."""
        return self._recorder is not None

    def forward(self, records: Sequence[SequenceRecord], hidden: mx.array, in_flight: int = 0,
                evaluate: bool = True) -> mx.array:
        """Run every record's rows through this stage's layers; ``[T, hidden]`` out.

        ``in_flight`` is how many batches the pipeline holds (this one included; 0: unknown);
        the BLAS pool is sized for it, and the last stage's sampling runs with the same pool.
        ``evaluate=False`` leaves the output lazy for a caller that evaluates it with more work
        (the last stage: with the sampled tokens, in one device sync instead of two).
        """
        if self._threads is not None:
            self._threads.for_load(in_flight)
        if self.mirror is not None:
            self.mirror.send(records, hidden, in_flight)
        # Sequences that ended earlier are released (their prefix kept, where the entry stage says so) and
        # evicted prefix entries dropped before this batch's new ones take their places.
        self._apply_prefix_records(records)
        released = [r.seq_id for r in records if r.num_tokens == 0 and r.has(RecordFlag.RELEASE)]
        self.kv.release_many(released)
        if len(self.rows):
            self.rows.release(released)
        segments: list[Segment] = []
        grouped: list[SequenceRecord] = []  # decodes and verifications: the batched decode group's step
        decode_rows: list[int] = []
        row = 0
        for r in records:
            if r.num_tokens == 0:
                continue
            if not r.has(RecordFlag.NEW_SEQUENCE) and (r.num_tokens == 1 or r.has(RecordFlag.VERIFY)):
                grouped.append(r)
                decode_rows += range(row, row + r.num_tokens)
            else:
                caches = self.kv.for_chunk(r.seq_id, r.start_pos, r.has(RecordFlag.NEW_SEQUENCE), r.num_tokens,
                                           r.prefix_entry)
                segments.append(Segment(caches, r.num_tokens, row))
            row += r.num_tokens
        if row != hidden.shape[0]:
            raise wire.WireMismatchError(f"batch records cover {row} rows but the payload has {hidden.shape[0]}")
        decode = None
        if len(grouped) == 1:
            # A lone decode (or verification) runs as a chunk on plain caches: mlx-lm's own single-sequence
            # path, without the group's mask and gathers (on a GPU the step is bound by launching kernels).
            (r,) = grouped
            caches = self.kv.for_chunk(r.seq_id, r.start_pos, False, r.num_tokens, verify=r.has(RecordFlag.VERIFY))
            segments.append(Segment(caches, r.num_tokens, decode_rows[0]))
        elif grouped:
            lengths = tuple(r.num_tokens for r in grouped)
            group = self.kv.for_decode([r.seq_id for r in grouped], [r.start_pos for r in grouped], lengths)
            decode = DecodeRows(decode_rows, group, lengths if max(lengths) > 1 else ())
        if not segments and decode is None:
            return hidden
        out = self.model.run_packed(hidden, segments, decode)
        if evaluate:
            # Every chunk's output depends on its updated KV buffers, so this also commits the KV writes.
            mx.eval(out)
        return out

    def _apply_prefix_records(self, records: Sequence[SequenceRecord]) -> None:
        for r in records:
            if r.num_tokens or not r.flags & (RecordFlag.RETAIN | RecordFlag.EVICT):
                continue
            if r.has(RecordFlag.EVICT):
                self.kv.evict(r.prefix_entry)
            else:
                self.kv.retain(r.seq_id, r.prefix_entry, r.start_pos)

    def sample(self, records: Sequence[SequenceRecord], hidden: mx.array, wait: bool = True,
               drafts: Mapping[int, tuple[int, ...]] | None = None) -> PendingSample:
        """Norm, head, logits processors and sampling for the records flagged SAMPLE (every row of a
        VERIFY record, whose ``drafts`` are given); ``PendingSample.reply`` gives the TOKENS records and ids.

        Evaluates ``hidden`` (and so the batch's KV writes) together with the tokens: one sync.
        ``wait=False`` only starts that evaluation (``mx.async_eval``): the tokens are read later,
        while the device already runs what was queued after them.

        A VERIFY record's rows are each processed and sampled as they would be without speculation (row i as
        if the first i proposals had been generated: ``VerifyLayout``), and the record keeps the tokens
        ``accept_proposals`` keeps against the proposals (their ids ride the FORWARD body); its TOKENS record
        holds that many ids, each with its own row's logprobs. Only the kept tokens advance the sequence's
        options' state (penalty counts, grammar). Every stage drops a sequence's rejected positions when its
        next record starts before them (``kv_store``).
        """
        sampling = self.build_sample(records, hidden, drafts)
        self.evaluate_sample(sampling, wait)
        return sampling

    def build_sample(self, records: Sequence[SequenceRecord], hidden: mx.array,
                     drafts: Mapping[int, tuple[int, ...]] | None = None) -> PendingSample:
        """``sample``'s graph, built but not evaluated (its input may still be a placeholder)."""
        picks: list[int] = []
        chosen: list[SequenceRecord] = []
        row_seq_ids: list[int] = []
        positions: list[int] = []
        runs: list[tuple[int, ...] | None] = []  # each chosen record's proposals (None: not a verification)
        row = 0
        for record in records:
            row += record.num_tokens
            if not record.has(RecordFlag.SAMPLE) or record.num_tokens == 0:
                continue
            chosen.append(record)
            # A verification needs the target's token after every proposal prefix: all of its rows.
            runs.append(self._proposals(record, drafts) if record.has(RecordFlag.VERIFY) else None)
            rows = record.num_tokens if record.has(RecordFlag.VERIFY) else 1
            picks += range(row - rows, row)
            row_seq_ids += [record.seq_id] * rows
            end = record.start_pos + record.num_tokens  # the position the record's last row's token takes
            positions += range(end - rows + 1, end + 1)
        if not chosen:
            return PendingSample(mx.zeros((0,), dtype=mx.int32), None, (hidden,), [], None)
        layout = VerifyLayout.of(runs) if any(run is not None for run in runs) else None
        logits = self.model.logits(hidden[mx.array(picks)])
        logits = self.rows.process(logits, row_seq_ids, positions, layout)  # untouched when no row has options
        samplings = [r.sampling for r in chosen for _ in range(r.num_tokens if r.has(RecordFlag.VERIFY) else 1)]
        tokens = sample_rows(logits, samplings, positions, self.rows.min_ps(row_seq_ids))
        logprobs = self.rows.logprobs(logits, tokens, row_seq_ids)
        self.rows.observe(row_seq_ids, tokens, layout)
        extra = self.rows.pending() + (logprobs.arrays() if logprobs is not None else [])
        verify = {r.seq_id: run for r, run in zip(chosen, runs, strict=True) if run is not None}
        return PendingSample(tokens, logprobs, (tokens, logits, hidden, *extra), chosen, logits,
                             tuple(row_seq_ids), verify)

    @staticmethod
    def _proposals(record: SequenceRecord, drafts: Mapping[int, tuple[int, ...]] | None) -> tuple[int, ...]:
        """A VERIFY record's proposals, checked to be one fewer than its rows."""
        proposed = (drafts or {}).get(record.seq_id)
        if proposed is None or len(proposed) != record.num_tokens - 1:
            raise wire.WireMismatchError(
                f"sequence {record.seq_id}: a verification of {record.num_tokens} tokens came with "
                f"{'no' if proposed is None else len(proposed)} proposals, expected {record.num_tokens - 1}")
        return proposed

    def evaluate_sample(self, sampling: PendingSample, wait: bool = True) -> None:
        """Evaluate what ``build_sample`` built (``wait=False``: only start it), recording logits if asked."""
        evaluate = mx.eval if wait or self._recorder is not None else mx.async_eval
        evaluate(*sampling.evaluate)
        if self._recorder is not None and sampling.logits is not None:
            logits = sampling.logits
            if sampling.verifies:  # each record's last row, as without a verification
                last = sampling.last_rows()
                logits = logits[mx.array([last[r.seq_id] for r in sampling.chosen])]
            self._recorder.add(sampling.chosen, logits)

    def accept(self, sampled: Sequence[SampledToken]) -> None:
        """Advance constrained sequences' grammars with their kept ids (nothing to do without one)."""
        if self.rows.has_grammar:
            self.rows.accept([t.seq_id for t in sampled], [t.token_id for t in sampled])

    def release_finished(self, records: Sequence[SequenceRecord]) -> None:
        released = [r.seq_id for r in records if r.has(RecordFlag.RELEASE)]
        self.kv.release_many(released)
        if len(self.rows):
            self.rows.release(released)


@dataclass(frozen=True)
class PendingSample:
    """The last stage's sampling graph for one batch, built and not yet evaluated."""

    tokens: mx.array  # one per sampled row: a record's last row, or every row of a VERIFY record
    logprobs: LogprobRows | None  # its rows index ``tokens``
    evaluate: tuple[mx.array, ...]  # what one evaluation must cover (the batch's KV writes included)
    chosen: list[SequenceRecord]  # the FORWARD records sampled from, in row order
    logits: mx.array | None
    row_seq_ids: tuple[int, ...] = ()  # the sequence of each of ``tokens``
    drafts: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # VERIFY records' proposals

    @property
    def verifies(self) -> bool:
        return bool(self.drafts)

    def last_rows(self) -> dict[int, int]:
        """Each sampled sequence's last row in ``tokens`` (where a carried step takes its input)."""
        return {seq_id: row for row, seq_id in enumerate(self.row_seq_ids)}

    def reply(self, token_ids: Sequence[int]) -> TokensReply:
        """The TOKENS records and ids of ``token_ids`` (``tokens`` read back): one per plain record, the
        kept run of a VERIFY record."""
        records: list[SequenceRecord] = []
        ids: list[int] = []
        rows: list[int] = []
        row = 0
        for r in self.chosen:
            if r.has(RecordFlag.VERIFY):
                kept = accept_proposals(token_ids[row:row + r.num_tokens], self.drafts[r.seq_id])
                rows += range(row, row + len(kept))  # kept token i is row i's (``accept_proposals``)
                row += r.num_tokens
            else:
                kept = (int(token_ids[row]),)
                rows.append(row)
                row += 1
            # The position the first kept token occupies: after the record's last row, or after its first.
            first = r.start_pos + 1 if r.has(RecordFlag.VERIFY) else r.start_pos + r.num_tokens
            records.append(SequenceRecord(r.seq_id, first, len(kept)))
            ids += kept
        return TokensReply(records, ids, rows)


@dataclass(frozen=True)
class TokensReply:
    """The last stage's answer to a batch: TOKENS records, their ids in order, and the row of ``tokens`` each
    id was sampled at (where its logprobs are)."""

    records: list[SequenceRecord]
    ids: list[int]
    rows: list[int]

    def sampled(self) -> list[SampledToken]:
        return _sampled(self.records, self.ids)


@dataclass(frozen=True)
class _RemoteBatch:
    """A batch handed to the next stage: its id, and the sequences the last stage samples, in reply order."""

    batch_id: int
    sampled_seq_ids: tuple[int, ...]


@dataclass(frozen=True)
class _CarrySource:
    """Where carried decode steps take their input token: ``tokens[index[seq_id]]``."""

    tokens: mx.array
    index: dict[int, int]
    slots: Placeholder | None = None  # multi-stage: ``tokens`` is this placeholder, written on the reply
    after: int = 0  # multi-stage: the batch whose reply writes it


@dataclass(frozen=True)
class _PendingLaunch:
    """A batch announced and built on the entry stage, waiting for the tokens of batch ``after``."""

    after: int
    hidden: mx.array  # this stage's output, lazy
    token_slots: Placeholder  # ``after``'s sampled tokens, in its reply order
    rows: int
    build_s: float


@dataclass(frozen=True)
class _LocalBatch:
    """A single-stage pipeline's batch in flight: its sampling, tokens still on the device."""

    sampling: PendingSample
    rows: int  # token rows computed
    build_s: float  # host time spent building it
    readback: mx.array  # the tokens ``collect`` reads: ``sampling.tokens``, or with a launcher a copy of them
    launched: Launched | None = None  # with a launcher: its launch, waited for before ``readback`` is read


class EntryPipeline:
    """The first stage: pushes batches into the pipeline and collects their sampled tokens.

    ``submit`` computes this stage's part of a batch and hands it to the next
    stage without waiting, so several micro-batches can be in flight at once
    (stage 0 computes batch B while stage 1 computes batch A); ``collect``
    returns the oldest batch's tokens. Replies come back in submission order.
    """

    def __init__(
        self,
        compute: StageCompute,
        outbound: OutboundLink | None,
        inbound: InboundLink | None,
        is_last: bool,
        reply_timeout_s: float = 30.0,
        on_batch: BatchTimer | None = None,
        on_wait: Callable[[float], None] | None = None,
        build_ahead: bool = False,
        launcher: KernelLauncher | None = None,
    ) -> None:
        if launcher is not None and not is_last:
            raise ValueError("a kernel launcher serves a single-stage pipeline only (stage_worker.engine.launcher)")
        self._compute = compute
        self._launcher = launcher
        if launcher is not None:
            compute.kv.evaluate_later = launcher.launch
        self._reply_timeout_s = reply_timeout_s
        self._on_batch = on_batch
        self._on_wait = on_wait
        self._outbound = outbound
        self._inbound = inbound
        self._is_last = is_last
        self._build_ahead = build_ahead and not is_last and outbound is not None and outbound.can_announce
        self._batch_id = 0
        self._in_flight: deque[_RemoteBatch] = deque()  # batches handed on (or announced), oldest first
        self._pending: _PendingLaunch | None = None
        # Single-stage pipelines: each batch's sampled tokens, still on the device until ``collect``
        # reads them; the oldest also feeds ``Chunk.carried`` decode steps.
        self._local_results: deque[_LocalBatch] = deque()

    @property
    def single_stage(self) -> bool:
        """This stage is also the last: tokens are sampled here (and can feed the next step on the device)."""
        return self._is_last

    @property
    def launches_apart(self) -> bool:
        """A kernel launcher evaluates this pipeline's steps on a thread of its own."""
        return self._launcher is not None

    @property
    def builds_ahead(self) -> bool:
        """Headers go to the next stage before this stage computes (``OutboundLink.announce``)."""
        return self._build_ahead

    @property
    def can_carry(self) -> bool:
        """Whether ``submit`` takes ``Chunk.carried`` decode steps of the oldest batch in flight: on a
        single stage fed from the device, on a longer pipeline built ahead and fed from its reply. Never on a
        tensor-parallel stage: its members need each batch's input rows before it runs."""
        return (self._is_last or self._build_ahead) and self._compute.mirror is None

    @property
    def in_flight(self) -> int:
        return len(self._local_results) if self._is_last else len(self._in_flight)

    def step(self, chunks: Sequence[Chunk]) -> list[SampledToken]:
        """One batch through the whole pipeline (nothing else may be in flight)."""
        self.submit(chunks)
        return self.collect()

    def submit(self, chunks: Sequence[Chunk]) -> int:
        """Compute this stage's part of a batch and hand it on; a batch with carried steps is only
        built and announced, and runs once ``collect`` has the tokens it continues from."""
        records = [_with_seed(c.record) for c in chunks]
        for chunk in chunks:
            expected = 0 if chunk.carried else chunk.record.num_tokens
            if len(chunk.token_ids) != expected or (chunk.carried and chunk.record.num_tokens != 1):
                raise ValueError(f"sequence {chunk.record.seq_id}: record says "
                                 f"{chunk.record.num_tokens} tokens, chunk has {len(chunk.token_ids)}")
        if self._pending is not None:
            raise RuntimeError("a batch built ahead must run (collect) before another is submitted")
        self._batch_id += 1
        in_flight = self.in_flight + 1
        model = self._compute.model
        started = time.perf_counter()
        options = {c.record.seq_id: c.options for c in chunks if c.options is not None}
        if self._is_last:
            if self._launcher is None:
                self._submit_local(chunks, records, options, in_flight, started)
            else:
                with mx.stream(self._launcher.stream):  # a stream the launcher's thread may evaluate
                    self._submit_local(chunks, records, options, in_flight, started)
            return self._batch_id
        assert self._outbound is not None
        source = self._remote_carry_source(chunks)
        ids = self._input_ids(chunks, source)
        hidden = self._compute.forward(records, self._embed(ids), in_flight, evaluate=False)
        body = _forward_body(rows_body({s: o for s, o in options.items() if not o.is_default}),
                             drafts_body({c.record.seq_id: c.token_ids[1:] for c in chunks
                                          if c.record.has(RecordFlag.VERIFY)}))
        sampled = tuple(r.seq_id for r in records if r.has(RecordFlag.SAMPLE) and r.num_tokens > 0)
        self._in_flight.append(_RemoteBatch(self._batch_id, sampled))
        rows = int(ids.size)
        if self._build_ahead and rows:
            # The next stage builds its part while this one computes (or waits for the tokens it continues from).
            self._outbound.announce(FrameKind.FORWARD, records, rows, model.hidden_size, model.dtype,
                                    batch_id=self._batch_id, body=body, in_flight=in_flight)
            if source is not None and source.slots is not None:
                self._pending = _PendingLaunch(source.after, hidden, source.slots, rows,
                                               time.perf_counter() - started)
            else:
                self._run_announced(hidden, rows, time.perf_counter() - started)
        else:
            mx.eval(hidden)  # also commits the batch's KV writes
            computed = time.perf_counter()
            self._outbound.send(FrameKind.FORWARD, records, hidden, batch_id=self._batch_id, in_flight=in_flight,
                                body=body)
            if self._on_batch is not None:
                self._on_batch(rows, computed - started, 0.0, time.perf_counter() - computed)
        self._compute.release_finished(records)
        return self._batch_id

    def _submit_local(self, chunks: Sequence[Chunk], records: list[SequenceRecord], options: dict[int, RowOptions],
                      in_flight: int, started: float) -> None:
        """``submit`` on a single stage: the batch's layers and sampling, queued on the device."""
        ids = self._input_ids(chunks, self._local_carry_source(chunks))
        hidden = self._compute.forward(records, self._embed(ids), in_flight, evaluate=False)
        if options:
            self._compute.rows.register(options)
        drafts = {c.record.seq_id: c.token_ids[1:] for c in chunks if c.record.has(RecordFlag.VERIFY)}
        launched = None
        if self._launcher is not None:
            sampling = self._compute.build_sample(records, hidden, drafts)
            # The next step's graph takes ``tokens``: this thread reads a copy that no queued graph takes.
            readback = mx.contiguous(sampling.tokens)
            launched = self._launcher.launch([*sampling.evaluate, readback])
        else:
            sampling = self._compute.sample(records, hidden, wait=False, drafts=drafts)
            readback = sampling.tokens
        # Its compute is counted in ``collect``, once the device has finished it.
        # Kept until ``collect`` without what only its evaluation needed (the batch's hidden states, logits).
        kept = replace(sampling, evaluate=(), logits=None)
        self._local_results.append(_LocalBatch(kept, int(ids.size), time.perf_counter() - started, readback,
                                               launched))
        self._compute.release_finished(records)

    def _embed(self, ids: mx.array) -> mx.array:
        model = self._compute.model
        return model.embed(ids) if ids.size else mx.zeros((0, model.hidden_size), dtype=model.dtype)

    def _run_announced(self, hidden: mx.array, rows: int, build_s: float) -> None:
        """Evaluate an announced batch and send its payload."""
        assert self._outbound is not None
        running = time.perf_counter()
        mx.eval(hidden)  # also commits the batch's KV writes
        computed = time.perf_counter()
        self._outbound.send_announced(hidden)
        if self._on_batch is not None:
            self._on_batch(rows, build_s + computed - running, 0.0, time.perf_counter() - computed)

    def _local_carry_source(self, chunks: Sequence[Chunk]) -> _CarrySource | None:
        """Single stage: carried steps continue from the oldest batch's tokens, still on the device."""
        if not any(c.carried for c in chunks):
            return None
        if not self._local_results:
            raise ValueError("a carried decode step needs a batch in flight before it on this stage")
        previous = self._local_results[0].sampling
        return _CarrySource(previous.tokens, previous.last_rows())

    def _remote_carry_source(self, chunks: Sequence[Chunk]) -> _CarrySource | None:
        """Longer pipeline: carried steps continue from the oldest batch in flight, whose tokens the
        last stage has not returned yet: a placeholder, written when they come (``collect``)."""
        if not any(c.carried for c in chunks):
            return None
        if not self._build_ahead:
            raise ValueError("carried decode steps on a multi-stage pipeline need it built ahead (lane payloads)")
        if not self._in_flight:
            raise ValueError("a carried decode step needs a batch in flight before it on this stage")
        oldest = self._in_flight[0]
        slots = Placeholder((len(oldest.sampled_seq_ids),), mx.int32)
        return _CarrySource(slots.array, {seq_id: i for i, seq_id in enumerate(oldest.sampled_seq_ids)}, slots,
                            oldest.batch_id)

    @staticmethod
    def _input_ids(chunks: Sequence[Chunk], source: _CarrySource | None) -> mx.array:
        """The batch's token ids in row order; a carried chunk's is gathered from ``source`` on the
        device, without reading it back."""
        if source is None:
            return mx.array([t for c in chunks for t in c.token_ids], dtype=mx.int32)
        previous_tokens, index = source.tokens, source.index
        parts: list[mx.array] = []
        run: list[int] = []  # positions in the previous tokens of consecutive carried chunks: one gather each
        for chunk in chunks:
            if chunk.carried:
                if chunk.record.seq_id not in index:
                    raise ValueError(f"sequence {chunk.record.seq_id} sampled nothing in the batch it continues")
                run.append(index[chunk.record.seq_id])
                continue
            if run:
                parts.append(previous_tokens[mx.array(run)])
                run = []
            if chunk.token_ids:
                parts.append(mx.array(chunk.token_ids, dtype=mx.int32))
        if run:
            parts.append(previous_tokens[mx.array(run)])
        ids = parts[0] if len(parts) == 1 else mx.concatenate(parts) if parts else mx.zeros((0,), mx.int32)
        return ids.astype(mx.int32)

    def collect(self) -> list[SampledToken]:
        """Tokens of the oldest batch in flight (waits for them on the lane, not spinning); a batch
        built ahead to continue from them runs before they are returned."""
        if self._is_last:
            batch = self._local_results.popleft()
            reading = time.perf_counter()
            sampling = batch.sampling
            if batch.launched is not None:
                batch.launched.wait()
            # Reads the tokens back: waits for this batch only.
            kept = sampling.reply(np.array(batch.readback).tolist())
            sampled = kept.sampled()
            self._compute.accept(sampled)
            if sampling.logprobs is not None:
                by_row = sampling.logprobs.read()
                sampled = [replace(t, logprob=by_row[row]) if row in by_row else t
                           for t, row in zip(sampled, kept.rows, strict=True)]
            if self._on_batch is not None:
                # Building the batch plus waiting for the device to finish it: this stage's compute.
                self._on_batch(batch.rows, batch.build_s + time.perf_counter() - reading, 0.0, 0.0)
            return sampled
        assert self._inbound is not None
        expected = self._in_flight.popleft()
        waited = time.perf_counter()
        reply = self._inbound.recv(timeout_s=self._reply_timeout_s)
        if reply.kind != FrameKind.TOKENS or reply.header.batch_id != expected.batch_id:
            raise wire.WireMismatchError(
                f"expected TOKENS for batch {expected.batch_id}, got {reply.kind.name} for batch "
                f"{reply.header.batch_id}"
            )
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - waited)
        ids = np.array(reply.payload).tolist() if reply.payload is not None else []
        sampled = _sampled(reply.records, ids)
        pending = self._pending
        if pending is not None and pending.after == expected.batch_id:
            self._pending = None
            if tuple(r.seq_id for r in reply.records) != expected.sampled_seq_ids:
                raise wire.WireMismatchError(
                    f"batch {expected.batch_id}'s tokens came back for sequences {[r.seq_id for r in reply.records]}, "
                    f"expected {list(expected.sampled_seq_ids)}")
            # Each sequence's last token feeds its carried step (a verifying sequence is never carried).
            last = {t.seq_id: t.token_id for t in sampled}
            pending.token_slots.write(np.array([last[r.seq_id] for r in reply.records], dtype=np.int32))
            self._run_announced(pending.hidden, pending.rows, pending.build_s)
        logprobs = logprobs_from_body(reply.body)
        return _with_logprobs(sampled, logprobs) if logprobs else sampled

    def pipeline_kv_capacity(self, own_tokens: int) -> int:
        """The smallest KV token capacity of any stage: a CAPACITY message goes round the ring once."""
        if self._outbound is None or self._inbound is None:
            return own_tokens
        self._outbound.send(FrameKind.CAPACITY, body={"kv_tokens": own_tokens})
        reply = self._inbound.recv(timeout_s=self._reply_timeout_s)
        if reply.kind != FrameKind.CAPACITY or reply.body is None:
            raise wire.WireMismatchError(f"expected CAPACITY back from the ring, got {reply.kind.name}")
        return int(reply.body["kv_tokens"])

    def shutdown(self) -> None:
        """Drain what is in flight, send SHUTDOWN round the ring and wait for it to come back."""
        while self.in_flight:
            self.collect()
        if self._launcher is not None:
            self._launcher.close()
        if self._outbound is None or self._inbound is None:
            return
        self._outbound.send(FrameKind.SHUTDOWN)
        while True:
            message = self._inbound.recv(timeout_s=self._reply_timeout_s)
            if message.kind == FrameKind.SHUTDOWN:
                return


def _sampled(records: Sequence[SequenceRecord], ids: Sequence[int]) -> list[SampledToken]:
    """TOKENS records and their ids (each record's ``num_tokens`` in turn) as tokens, in order."""
    total = sum(r.num_tokens for r in records)
    if total != len(ids):
        raise wire.WireMismatchError(f"TOKENS records cover {total} ids but {len(ids)} came")
    out, row = [], 0
    for r in records:
        out += [SampledToken(r.seq_id, r.start_pos + i, int(ids[row + i])) for i in range(r.num_tokens)]
        row += r.num_tokens
    return out


def _forward_body(*parts: dict | None) -> dict | None:
    """A FORWARD body of its parts (new sequences' options, proposals to verify); None when all are."""
    body = {key: value for part in parts if part for key, value in part.items()}
    return body or None


def _with_logprobs(sampled: list[SampledToken], logprobs: Mapping[int, Sequence[TokenLogprob]]) -> list[SampledToken]:
    """``sampled`` with each sequence's logprobs, one per token of it in order (a TOKENS reply's body)."""
    out, taken = [], dict.fromkeys(logprobs, 0)
    for t in sampled:
        if t.seq_id in logprobs:
            entries = logprobs[t.seq_id]
            if taken[t.seq_id] >= len(entries):
                raise wire.WireMismatchError(f"sequence {t.seq_id}: {len(entries)} logprobs came for more tokens")
            t = replace(t, logprob=entries[taken[t.seq_id]])
            taken[t.seq_id] += 1
        out.append(t)
    return out


def relay_loop(
    compute: StageCompute,
    inbound: InboundLink,
    outbound: OutboundLink,
    is_last: bool,
    on_batch: BatchTimer | None = None,
    kv_token_capacity: int | None = None,
    build_ahead: bool = False,
) -> None:
    """Middle and last stages: receive, compute, pass on; return after SHUTDOWN.

    With ``build_ahead`` (``build_ahead.build_ahead_enabled``; on lane payloads only: a ring receive is
    sized and posted only once the header is in), a batch's graph is
    built as soon as its header is in, on a placeholder its hidden states are received into: the
    building overlaps the previous stage's compute (it sends headers ahead, ``OutboundLink.announce``),
    and a middle stage announces its own header downstream before computing, for the same reason.
    """
    model = compute.model
    build_ahead = build_ahead and inbound.lane_payloads

    def check(header: wire.FrameHeader) -> None:
        if header.kind == FrameKind.FORWARD:
            wire.check_forward_header(
                header, hidden_size=model.hidden_size, wire_dtype=model.dtype, sender=inbound.peer_name
            )

    while True:
        waited = time.perf_counter()
        message = inbound.recv_head(check=check)
        header = message.header
        if message.kind == FrameKind.SHUTDOWN:
            outbound.send(FrameKind.SHUTDOWN)
            return
        if message.kind == FrameKind.CAPACITY and message.body is not None:
            kv_tokens = int(message.body["kv_tokens"])
            if kv_token_capacity is not None:
                kv_tokens = min(kv_tokens, kv_token_capacity)
            outbound.send(FrameKind.CAPACITY, body={"kv_tokens": kv_tokens})
            continue
        if message.kind != FrameKind.FORWARD:
            raise wire.WireMismatchError(f"{inbound.peer_name} sent unexpected {message.kind.name}")
        placeholder = None
        if not header.has_payload:  # a batch of zero-token records (releases only)
            hidden = mx.zeros((0, model.hidden_size), dtype=model.dtype)
        elif build_ahead:
            placeholder = Placeholder(header.payload_shape, model.dtype)
            hidden = placeholder.array
        else:
            hidden = inbound.recv_payload(header)
        started = time.perf_counter()
        announced = not is_last and placeholder is not None and outbound.can_announce
        if announced:
            outbound.announce(FrameKind.FORWARD, message.records, header.num_rows, model.hidden_size, model.dtype,
                              batch_id=header.batch_id, body=message.body, in_flight=header.in_flight)
        hidden = compute.forward(message.records, hidden, header.in_flight, evaluate=False)
        sampling = None
        if is_last:
            if message.body:
                compute.rows.register(rows_from_body(message.body))
            sampling = compute.build_sample(message.records, hidden, drafts_from_body(message.body))
        built = time.perf_counter()
        if placeholder is not None:
            inbound.recv_payload_into(header, placeholder.writable())
        arrived = time.perf_counter()
        if sampling is not None:
            compute.evaluate_sample(sampling)
            token_ids = np.array(sampling.tokens).tolist()
            reply = sampling.reply(token_ids)
            if compute.rows.has_grammar:
                compute.accept(reply.sampled())
            computed = time.perf_counter()
            logprobs = sampling.logprobs
            # Without a verification the reply is the sampled tokens as they are (no copy).
            tokens = sampling.tokens if not sampling.verifies else mx.array(reply.ids, dtype=mx.int32)
            outbound.send(
                FrameKind.TOKENS,
                reply.records,
                tokens if reply.records else None,
                batch_id=header.batch_id,
                body=logprobs.to_body(sampling.row_seq_ids, reply.rows) if logprobs is not None else None,
            )
        else:
            # Every chunk's output depends on its updated KV buffers, so this also commits the KV writes.
            mx.eval(hidden)
            computed = time.perf_counter()
            if announced:
                outbound.send_announced(hidden)
            else:
                outbound.send(FrameKind.FORWARD, message.records, hidden, batch_id=header.batch_id,
                              in_flight=header.in_flight, body=message.body)
        compute.release_finished(message.records)
        if on_batch is not None:
            # Building ahead overlaps the wait for the payload; count it as compute all the same.
            build_s = built - started
            on_batch(hidden.shape[0], computed - arrived + build_s, arrived - waited - build_s,
                     time.perf_counter() - computed)


def _with_seed(record: SequenceRecord) -> SequenceRecord:
    """Unseeded random sampling gets a fresh seed here, so every stage layout samples alike."""
    if record.sampling.greedy or record.sampling.seed is not None:
        return record
    return replace(record, sampling=replace(record.sampling, seed=random.getrandbits(62)))


__all__ = ["EntryPipeline", "LinkError", "LogitRecorder", "StageCompute", "relay_loop"]
