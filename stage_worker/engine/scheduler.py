"""Entry-stage scheduling: which sequences go into the next batch. Pure logic, no threads, no MLX.

It imports nothing of the runtime: it plans with the plain values of ``stage_worker.batch`` (records,
chunks, sampled tokens) and the prefix cache's bookkeeping, and the caller runs the plan. ``Scheduler`` does
continuous batching: requests join (``add``, through a bounded waiting queue) and leave (finished,
``abort``) at every step. The caller (``engine``) runs ``next_batch`` -> pipeline -> ``on_sampled`` and
delivers the returned ``RequestEvent``s to the waiting RPCs; a single-stage pipeline also submits
``continuation(batch)`` right after ``batch``. Every running sequence reserves prompt + max_tokens tokens of
KV on every stage, so admitted work never runs the stages out of memory. With a ``PrefixCache`` admission
starts a sequence from its longest cached prefix; with a ``SpeculativeConfig`` a decode step may verify
proposals (``speculation``).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stage_worker.batch import Chunk, RecordFlag, RowOptions, SampledToken, SequenceRecord, TokenLogprob
from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.speculation.ngram_proposer import NgramProposer
from stage_worker.speculation.rules import (
    Acceptance,
    ProposalAsk,
    Proposer,
    SpecDecodeCounter,
    speculative_tokens,
)
from stagemesh_core import defaults
from stagemesh_core.sampling import GREEDY, SamplingParams
from stagemesh_core.speculative import NGRAM, SpeculativeConfig


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller answers RESOURCE_EXHAUSTED / 503."""


class RequestError(ValueError):
    """A request the stage cannot run; the message names the field to change."""


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt to generate for, as the entry stage's gRPC boundary accepted it (its sampling checked there)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True)
class RequestEvent:
    """New tokens for one request, and its finish reason once it is done."""

    request_id: str
    token_ids: tuple[int, ...]
    finish: Finish | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asked for logprobs
    cached_tokens: int = 0  # prompt positions its admission restored from the prefix cache


@dataclass
class _Sequence:
    seq_id: int
    request: GenerationRequest
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    holds_kv: bool = False
    in_flight_steps: int = 0  # batches holding this sequence now (2 with a continuation)
    aborted: bool = False
    prefix_entry: int = 0  # the prefix entry its first chunk copies (a reference held until it is sent)
    cached_tokens: int = 0  # prompt positions restored from that entry (what the APIs report as cached)
    acceptance: Acceptance = field(default_factory=Acceptance)

    @property
    def in_flight(self) -> bool:
        return self.in_flight_steps > 0

    @property
    def position(self) -> int:
        """Tokens fed to the pipeline so far (prompt chunks plus fed decode tokens)."""
        return self.prefilled + max(0, len(self.generated) - 1) if self.prefill_done else self.prefilled

    @property
    def prefill_done(self) -> bool:
        return self.prefilled == len(self.request.prompt)


@dataclass(frozen=True)
class Batch:
    chunks: tuple[Chunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.record.num_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching over ``stage_worker.batch`` values (see the module docstring).

    Requests are admitted from the waiting queue while fewer than ``max_num_seqs`` run. A finished or
    aborted sequence that holds KV on the stages gets a zero-token RELEASE record in the next batch.

    With a ``PrefixCache`` (``stage_worker.cache.prefix_cache``), admission looks the prompt up once: a hit starts
    the sequence's prefill at the cached length K (its first record is NEW_SEQUENCE at start_pos K, naming the
    entry to copy), least recently used entries are evicted (EVICT records) while the new reservation would
    not fit beside them, and a sequence that finishes (not one aborted) leaves its whole blocks behind (its
    RELEASE record gains RETAIN). The cache's tokens count against ``kv_token_capacity`` like reservations.
    A model whose entries are whole states (``PrefixCache(exact=True)``) also keeps each prompt's state before
    its last token: the prompt's prefill stops one token short, the next batch opens with a RETAIN record
    (without RELEASE) for that position, and the last token is prefilled (and sampled) after it
    (``_checkpoint_end``, ``_keep_checkpoint``), so a regenerated turn restores all but one token.

    With a ``SpeculativeConfig`` (``--speculative-config``), a decode step of a sequence that
    ``speculation.speculative_tokens`` lets speculate feeds its last sampled token and up to k proposals (the
    ``speculation.Proposer``: prompt lookup, or a draft model the caller passes in, asked once per step for
    all of them) as one VERIFY record at its position. The sequence's next record starts right after the
    tokens the last stage keeps, and every stage drops the rejected positions when it sees that record
    (``kv_store``).
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_waiting: int,
        max_batch_tokens: int = defaults.MAX_BATCH_TOKENS,
        prefill_chunk_tokens: int = defaults.MAX_BATCH_TOKENS,
        kv_token_capacity: int | None = None,
        prefix_cache: PrefixCache | None = None,
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_model_len < 2 or max_waiting < 0 or max_batch_tokens < 1:
            raise ValueError("max_num_seqs >= 1, max_model_len >= 2, max_waiting >= 0, max_batch_tokens >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_tokens = max(1, min(prefill_chunk_tokens, max_batch_tokens))
        self._waiting: deque[GenerationRequest] = deque()
        self._running: OrderedDict[int, _Sequence] = OrderedDict()
        self._by_request: dict[str, _Sequence] = {}
        self._releases: list[SequenceRecord] = []
        self._next_seq_id = 1
        self.finished_count = 0
        self.generated_count = 0  # tokens sampled for requests, all time (the replica's output)
        # Every running sequence reserves prompt + max_tokens tokens of KV on every stage, so
        # admitted work can never run the stages out of memory (no preemption needed).
        self.kv_token_capacity = kv_token_capacity
        self._reserved_tokens = 0
        self.prefix_cache = prefix_cache
        self.speculative = speculative
        if speculative is not None and proposer is None:
            if speculative.method != NGRAM:
                raise ValueError(f"speculative method {speculative.method!r} needs its proposer "
                                 "(stage_worker.speculation.draft_proposer)")
            proposer = NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        self.proposer = proposer if speculative is not None else None
        self.spec_decode = SpecDecodeCounter(speculative.num_speculative_tokens if speculative else 0)

    # -- admission -------------------------------------------------------
    def validate(self, request: GenerationRequest) -> None:
        if not request.prompt:
            raise RequestError("prompt_token_ids must hold at least one token")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
        total = len(request.prompt) + request.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds the model length {self.max_model_len} (--max-model-len); shorten the prompt "
                f"or lower max_tokens"
            )
        if self.kv_token_capacity is not None and total > self.kv_token_capacity:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens exceeds the KV capacity of the pipeline "
                f"({self.kv_token_capacity} tokens); lower max_tokens"
            )
        if request.request_id in self._by_request or any(r.request_id == request.request_id for r in self._waiting):
            raise RequestError(f"request_id {request.request_id!r} is already running")

    def add(self, request: GenerationRequest) -> None:
        self.validate(request)
        free_slots = self.max_num_seqs - len(self._running)
        if len(self._waiting) >= self.max_waiting + max(0, free_slots):
            raise QueueFullError(
                f"the stage is full: {len(self._running)} sequences running (--max-num-seqs "
                f"{self.max_num_seqs}) and {len(self._waiting)} waiting (--max-waiting "
                f"{self.max_waiting}); retry later"
            )
        self._waiting.append(request)

    def abort(self, request_id: str) -> RequestEvent | None:
        """Abort a waiting or running request; returns its final event if it was found."""
        for request in self._waiting:
            if request.request_id == request_id:
                self._waiting.remove(request)
                self.finished_count += 1
                return RequestEvent(request_id, (), Finish.ABORT, len(request.prompt), 0)
        seq = self._by_request.get(request_id)
        if seq is None or seq.aborted:
            return None
        seq.aborted = True
        if not seq.in_flight:
            self._retire(seq)
        return RequestEvent(request_id, (), Finish.ABORT, len(seq.request.prompt), len(seq.generated))

    # -- stepping --------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        """Whether ``next_batch`` would return something to compute."""
        admissible = bool(self._waiting) and len(self._running) < self.max_num_seqs and self._fits(self._waiting[0])
        return admissible or bool(self._releases) or any(
            not s.in_flight and not s.aborted for s in self._running.values()
        )

    def next_batch(self, micro_batches: int = 1) -> Batch:
        """The next batch; with ``micro_batches`` > 1 it takes at most 1/micro_batches of the
        running sequences, so the rest can fill the other micro-batches in flight.

        After the RELEASE and EVICT records, a batch holds one decode token (or a verification) for every
        running sequence whose last sampled token has not been fed yet, in the order their prompts finished
        (the order the stages' decode groups hold them), then prompt chunks of at most
        ``prefill_chunk_tokens`` per sequence while the batch has fewer than ``max_batch_tokens`` rows, so a
        long prompt is prefilled over several steps instead of stalling the running decodes. Only a prompt's
        last chunk asks the last stage to sample."""
        while self._waiting and len(self._running) < self.max_num_seqs and self._fits(self._waiting[0]):
            request = self._waiting.popleft()
            self._reserved_tokens += _reservation(request)
            seq = _Sequence(self._next_seq_id, request)
            self._next_seq_id += 1
            self._reuse_prefix(seq)
            self._running[seq.seq_id] = seq
            self._by_request[request.request_id] = seq
        chunks: list[Chunk] = [Chunk(r, ()) for r in self._releases]
        self._releases = []
        budget = self.max_batch_tokens
        seats = -(-len(self._running) // max(1, micro_batches))  # ceil: sequences this batch may take
        # Decodes first: they are latency bound. ``_running`` lists them in the order their prompts
        # finished (see the end), the order they joined the stages' decode groups (kv_store): listed in
        # admission order, a short prompt admitted after a long one would make every stage regroup.
        # Who decodes and how many proposals each may have first, then one call for every proposal of the step
        # (a draft model computes them as one batch); rows reserved for proposals not made go to prompts.
        decoding: list[tuple[_Sequence, int]] = []
        for seq in self._running.values():
            if seq.in_flight or seq.aborted or not seq.prefill_done or budget <= 0 or seats <= 0:
                continue
            wanted = self._speculation_wanted(seq, budget, len(seq.generated))
            if not wanted:
                seq.acceptance = seq.acceptance.after_plain_step()
            decoding.append((seq, wanted))
            budget -= 1 + wanted
            seats -= 1
        proposals = self._propose(decoding)
        for seq, wanted in decoding:
            drafts = proposals.get(seq.seq_id, ())[:wanted]
            budget += wanted - len(drafts)
            tokens = (seq.generated[-1], *drafts)
            flags = RecordFlag.SAMPLE | RecordFlag.VERIFY if drafts else RecordFlag.SAMPLE
            record = SequenceRecord(seq.seq_id, seq.position, len(tokens), flags, seq.request.sampling)
            chunks.append(Chunk(record, tokens))
            seq.in_flight_steps += 1
        finished_prompts: list[int] = []
        for seq in self._running.values():
            if seq.in_flight or seq.aborted or seq.prefill_done or budget <= 0 or seats <= 0:
                continue
            size = min(self.prefill_chunk_tokens, budget, len(seq.request.prompt) - seq.prefilled)
            checkpoint = self._checkpoint_end(seq, size)
            if checkpoint is not None:
                size = checkpoint - seq.prefilled
            flags = RecordFlag.NONE if seq.holds_kv else RecordFlag.NEW_SEQUENCE
            if seq.prefilled + size == len(seq.request.prompt):
                flags |= RecordFlag.SAMPLE
                finished_prompts.append(seq.seq_id)
            tokens = seq.request.prompt[seq.prefilled : seq.prefilled + size]
            # The sequence's options ride its first chunk (NEW_SEQUENCE), which starts past a cached prefix.
            options = _row_options(seq.request) if flags & RecordFlag.NEW_SEQUENCE else None
            chunks.append(Chunk(SequenceRecord(seq.seq_id, seq.prefilled, size, flags, seq.request.sampling,
                                               seq.prefix_entry), tokens, options=options))
            self._drop_prefix_reference(seq)  # every stage copies the entry in this batch, before any eviction
            if checkpoint is not None:
                # After the reference is dropped: the entry this sequence started from may be superseded.
                self._releases.extend(self._keep_checkpoint(seq, checkpoint))
            seq.prefilled += size
            seq.holds_kv = True
            seq.in_flight_steps += 1
            budget -= size
            seats -= 1
        for seq_id in finished_prompts:  # prompts still prefilling keep their admission order
            self._running.move_to_end(seq_id)
        return Batch(tuple(chunks))

    def _speculation_wanted(self, seq: _Sequence, budget: int, generated_after: int) -> int:
        """How many proposals ``seq`` may have verified in its next step (``speculation.speculative_tokens``),
        once it has ``generated_after`` tokens."""
        remaining = min(seq.request.max_tokens - generated_after,
                        self.max_model_len - len(seq.request.prompt) - generated_after)
        return speculative_tokens(self.speculative, running=len(self._running), remaining=remaining, budget=budget,
                                  acceptance=seq.acceptance)

    def _propose(self, decoding: Sequence[tuple[_Sequence, int]]) -> dict[int, tuple[int, ...]]:
        """The tokens each decoding sequence proposes to have verified this step, by seq_id (none: a plain
        decode step), asked of the proposer once for all of them."""
        asks = [ProposalAsk(seq.seq_id, seq.request.prompt + tuple(seq.generated), wanted)
                for seq, wanted in decoding if wanted]
        if not asks or self.proposer is None:
            return {}
        return self.proposer.propose(asks)

    def continuation(self, batch: Batch) -> Batch:
        """The next decode step of ``batch``'s sampling sequences, submitted before its tokens are read: fed on
        the device with the token being sampled (``Chunk.carried``), so the device computes step N+1 while the
        host reads step N's tokens. A VERIFY step is never continued: its next input is not one token.

        A sequence continues only if its step in ``batch`` cannot be its last by length; whether that
        step's token is a stop token is known only later (``on_sampled`` then drops the extra token). A
        sequence that may speculate in its next step does not continue: its proposals come from the token
        being sampled, so its next step waits for it (``next_batch``).
        """
        chunks = []
        for chunk in batch.chunks:
            record = chunk.record
            seq = self._running.get(record.seq_id)
            if seq is None or seq.aborted or record.num_tokens == 0 or not record.has(RecordFlag.SAMPLE) or \
                    record.has(RecordFlag.VERIFY):
                continue
            if seq.request.sampling.grammar:
                continue  # its next token's mask needs this token on the host first
            generated_after = len(seq.generated) + seq.in_flight_steps  # tokens once ``batch`` returns
            if generated_after >= seq.request.max_tokens or \
                    len(seq.request.prompt) + generated_after >= self.max_model_len:
                continue
            if self._speculation_wanted(seq, self.max_batch_tokens, generated_after):
                continue
            seq.acceptance = seq.acceptance.after_plain_step()
            position = record.start_pos + record.num_tokens
            chunks.append(Chunk(SequenceRecord(seq.seq_id, position, 1, RecordFlag.SAMPLE, seq.request.sampling),
                                (), carried=True))
            seq.in_flight_steps += 1
        return Batch(tuple(chunks))

    def on_sampled(self, batch: Batch, sampled: Sequence[SampledToken]) -> list[RequestEvent]:
        """Account for a finished batch; return the events to deliver. A verification's 1..k+1 kept tokens
        are appended one by one, the run cut where ``max_tokens``, the model length or a stop token would have
        ended the sequence without speculation."""
        by_seq: dict[int, list[SampledToken]] = {}
        for token in sampled:
            by_seq.setdefault(token.seq_id, []).append(token)
        events = []
        for chunk in batch.chunks:
            seq = self._running.get(chunk.record.seq_id)
            if seq is None or chunk.record.num_tokens == 0:
                continue  # retired meanwhile (a continued step after the stop token lands here)
            seq.in_flight_steps -= 1
            if seq.aborted:
                self._retire(seq)
                continue
            tokens = by_seq.get(seq.seq_id)
            if not tokens:
                continue  # a prompt chunk that did not sample yet
            if chunk.record.has(RecordFlag.VERIFY):
                drafted, accepted = chunk.record.num_tokens - 1, len(tokens) - 1
                self.spec_decode.record(drafted, accepted)
                seq.acceptance = seq.acceptance.after_verification(accepted)
            new_ids: list[int] = []
            logprobs: list[TokenLogprob] = []
            finish = None
            for token in tokens:  # a verification's run is cut where the sequence would have ended without it
                seq.generated.append(token.token_id)
                self.generated_count += 1
                new_ids.append(token.token_id)
                if token.logprob is not None:
                    logprobs.append(token.logprob)
                finish = self._finish_reason(seq, token.token_id)
                if finish is not None:
                    break
            events.append(RequestEvent(seq.request.request_id, tuple(new_ids), finish,
                                       len(seq.request.prompt), len(seq.generated), tuple(logprobs),
                                       seq.cached_tokens))
            if finish is not None:
                self._retire(seq)
        return events

    def fail_all(self) -> list[str]:
        """Forget every request (the pipeline broke); returns their ids."""
        ids = [r.request_id for r in self._waiting] + [s.request.request_id for s in self._running.values()]
        self._waiting.clear()
        self._running.clear()
        self._by_request.clear()
        self._releases.clear()
        self._reserved_tokens = 0
        if self.prefix_cache is not None:
            self.prefix_cache.clear()  # the stages' KV goes with the pipeline
        if self.proposer is not None:
            self.proposer.clear()
        return ids

    def _finish_reason(self, seq: _Sequence, token_id: int) -> Finish | None:
        if not seq.request.ignore_eos and token_id in seq.request.stop_token_ids:
            return Finish.STOP
        if len(seq.generated) >= seq.request.max_tokens:
            return Finish.LENGTH
        if len(seq.request.prompt) + len(seq.generated) >= self.max_model_len:
            return Finish.LENGTH
        return None

    def _fits(self, request: GenerationRequest) -> bool:
        if self.kv_token_capacity is None:
            return True
        # Unreferenced cached prefixes make way (``_reuse_prefix`` evicts them); referenced ones cannot yet.
        pinned = self.prefix_cache.pinned_tokens if self.prefix_cache is not None else 0
        return self._reserved_tokens + _reservation(request) + pinned <= self.kv_token_capacity

    def _reuse_prefix(self, seq: _Sequence) -> None:
        """Admission of ``seq`` (already reserved): start it from its longest cached prefix, and evict
        least recently used prefixes until the cache fits beside the reservations."""
        cache = self.prefix_cache
        if cache is None:
            return
        hit = cache.lookup(seq.request.prompt)
        if self.kv_token_capacity is not None:
            room = self.kv_token_capacity - self._reserved_tokens
            evicted = cache.evict_to(room)
            if hit is not None and cache.cached_tokens > room:
                # The entry cannot stay beside the new reservation while it is copied: prefill from 0.
                cache.cancel(hit)
                hit = None
                evicted += cache.evict_to(room)
            self._releases.extend(SequenceRecord(0, 0, 0, RecordFlag.EVICT, prefix_entry=e) for e in evicted)
        if hit is not None:
            seq.prefilled, seq.prefix_entry, seq.cached_tokens = hit.tokens, hit.entry_id, hit.tokens

    def _checkpoint_end(self, seq: _Sequence, size: int) -> int | None:
        """Where this prompt chunk of ``seq`` stops to take a checkpoint (its prompt's last position but one),
        or None: only for a whole-state cache, a prompt longer than a block whose checkpoint lies past what the
        sequence restored and within the ``size`` tokens this chunk would take."""
        cache = self.prefix_cache
        if cache is None or not cache.exact or seq.aborted:
            return None
        end = len(seq.request.prompt) - 1
        if end < cache.block_size or not seq.prefilled < end <= seq.prefilled + size:
            return None
        return end

    def _keep_checkpoint(self, seq: _Sequence, end: int) -> list[SequenceRecord]:
        """The records that keep ``seq``'s state at ``end`` as a prompt checkpoint on every stage, in the next
        batch (before the chunk that continues the sequence): room made by evicting least recently used
        entries, the RETAIN, and the EVICTs of the entries it supersedes. Nothing where the checkpoint cannot
        fit beside the running sequences' reservations and the referenced entries."""
        cache = self.prefix_cache
        assert cache is not None
        records: list[SequenceRecord] = []
        if self.kv_token_capacity is not None:
            room = self.kv_token_capacity - self._reserved_tokens - end
            if cache.pinned_tokens > room:
                return []
            records += [SequenceRecord(0, 0, 0, RecordFlag.EVICT, prefix_entry=e) for e in cache.evict_to(room)]
        kept = cache.insert_checkpoint(seq.request.prompt[:end])
        if kept.entry_id is None:
            return records
        return [*records, SequenceRecord(seq.seq_id, end, 0, RecordFlag.RETAIN, prefix_entry=kept.entry_id),
                *(SequenceRecord(0, 0, 0, RecordFlag.EVICT, prefix_entry=e) for e in kept.superseded)]

    def _drop_prefix_reference(self, seq: _Sequence) -> None:
        if seq.prefix_entry and self.prefix_cache is not None:
            self.prefix_cache.release(seq.prefix_entry)
        seq.prefix_entry = 0

    def _release_record(self, seq: _Sequence) -> list[SequenceRecord]:
        """The records that free a retiring sequence's KV everywhere, keeping its whole blocks as a prefix
        entry when it finished (an aborted one may hold a partial prompt: nothing is kept)."""
        release = SequenceRecord(seq.seq_id, seq.position, 0, RecordFlag.RELEASE)
        if self.prefix_cache is None or seq.aborted:
            return [release]
        kept = self.prefix_cache.insert(seq.request.prompt + tuple(seq.generated), seq.position)
        if kept.entry_id is None:
            return [release]
        evictions = [SequenceRecord(0, 0, 0, RecordFlag.EVICT, prefix_entry=e) for e in kept.superseded]
        return [SequenceRecord(seq.seq_id, kept.tokens, 0, RecordFlag.RELEASE | RecordFlag.RETAIN,
                               prefix_entry=kept.entry_id), *evictions]

    @property
    def reserved_tokens(self) -> int:
        return self._reserved_tokens

    def _retire(self, seq: _Sequence) -> None:
        if self._running.pop(seq.seq_id, None) is not None:
            self._reserved_tokens -= _reservation(seq.request)
        self._by_request.pop(seq.request.request_id, None)
        self.finished_count += 1
        self._drop_prefix_reference(seq)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)
        if seq.holds_kv:
            self._releases.extend(self._release_record(seq))


def _row_options(request: GenerationRequest) -> RowOptions | None:
    return RowOptions.for_sequence(request.sampling, request.prompt, request.stop_token_ids, request.ignore_eos)


def _reservation(request: GenerationRequest) -> int:
    return len(request.prompt) + request.max_tokens
