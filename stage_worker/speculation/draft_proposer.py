"""A draft model's proposals (vLLM's ``draft_model`` method): a small mlx-lm model on the entry stage.

Contract:
- ``check_draft_model(path, target)`` is the start check: an mlx-lm model directory sharing the target's
  vocabulary and tokenizer, its layers all keeping plain KV; anything else raises ``DraftModelError`` naming
  what to change. ``load_draft_proposer(path, weights)`` loads it as ``mlx_lm.load`` does, in the stage's
  compute dtype, its weights dense where the stage's own would be (``DraftWeights``).
- ``DraftProposer`` is a ``speculation.Proposer``: greedy proposals batched across the sequences asked, one
  device sync per round, the draft's KV kept from round to round in a ``draft_batch.DraftBatch``.
  ``take_timings`` says where the rounds' time went (``DraftTimings``).
- Greedy drafts make the last stage's acceptance exact for greedy and seeded requests alike
  (``speculation.accept_proposals``).
- It runs on the entry stage's model thread, inside the engine's lock as the scheduler does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from stage_worker.checkpoint.model_reader import ModelSpec, read_model_spec
from stage_worker.speculation.draft_batch import DraftBatch
from stage_worker.speculation.rules import ProposalAsk
from stagemesh_core.errors import UserError
from stagemesh_core.speculative import FLAG

log = logging.getLogger(__name__)

# Catch-up tokens per forward: a long prompt's prefill on the draft runs in slices, as mlx-lm prefills.
CATCH_UP_STEP = 512
# A sequence joining the batch with more tokens to catch up (a new sequence's prompt) runs them on its own first.
JOIN_CATCH_UP = 16


class DraftModelError(UserError):
    """A draft model that cannot propose for this target; the message names what to change."""


def check_draft_model(path: str, target: ModelSpec, target_tokenizer: Any | None = None) -> ModelSpec:
    """The draft at ``path`` as a spec, once it is an mlx-lm model directory (config.json, weights) whose
    ``vocab_size`` and tokenizer (every token's id) equal ``target``'s and whose layers all keep plain KV
    (positions it can drop); ``DraftModelError`` names what to change otherwise."""
    from stage_worker.checkpoint.model_reader import ModelFormatError
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    where = f"{FLAG} \"model\" {path!r}"
    if path.endswith(".gguf") and Path(path).is_file():
        raise DraftModelError(f"{where}: a GGUF file; a draft loads as mlx-lm loads a model: convert it first "
                              "(stagemesh convert) and give the directory")
    if not Path(path).is_dir() or not (Path(path) / "config.json").is_file():
        raise DraftModelError(f"{where}: not an mlx-lm model directory (no config.json there); give the "
                              "directory of a small model with the target's tokenizer")
    try:
        draft = read_model_spec(path)
    except (ModelFormatError, ValueError, json.JSONDecodeError) as exc:
        raise DraftModelError(f"{where}: cannot be read as a model: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(f"{where}: its vocab_size is {draft.vocab_size}, the target's {target.vocab_size}; "
                              "a draft must share the target's vocabulary")
    target_vocab = (target_tokenizer or load_tokenizer(target)).get_vocab()
    draft_vocab = load_tokenizer(draft).get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])
        raise DraftModelError(f"{where}: its tokenizer differs from the target's ({len(draft_vocab)} tokens "
                              f"against {len(target_vocab)}; e.g. {differing[0][0]!r} -> {differing[0][1]}); a "
                              "draft must share the target's tokenizer")
    kinds = _cache_kinds(draft)
    if kinds != {"KVCache"}:
        raise DraftModelError(f"{where}: its {draft.model_type} layers keep {', '.join(sorted(kinds - {'KVCache'}))}, "
                              "which cannot drop rejected proposals; use a draft whose layers all keep plain KV "
                              "(e.g. a Llama or Qwen model)")
    return draft


def _cache_kinds(spec: ModelSpec) -> set[str]:
    """The kinds of cache mlx-lm's model for ``spec`` keeps per layer (a lazy model: no weights drawn)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(dict(spec.args))
    return {type(cache).__name__ for cache in make_prompt_cache(model_class(args_class.from_dict(dict(spec.args))))}


@dataclass(frozen=True)
class DraftWeights:
    """What the entry stage decides its own weights by, which a quantized draft follows: ``--dequantize``, the
    backend, the BLAS, the memory budget and the compute dtype (``stage_model.choose_dense_weights``)."""

    dequantize: str = "off"
    backend: str = "cpu"
    blas: str = ""
    memory_budget: int = 0
    dtype: mx.Dtype = mx.float32

    @classmethod
    def on_this_machine(cls, memory_budget: int) -> DraftWeights:
        """What an entry stage with ``--dequantize auto`` on this machine and this BLAS decides by: for a draft
        loaded outside a stage (the bench, the tests). On the CPU with an optimized BLAS a quantized draft runs
        dense, as the stage's own weights, a quantized matmul being the slow path there."""
        from stage_worker.model.blas import loaded_blas
        from stage_worker.model.device import current_backend
        from stage_worker.model.stage_model import resolve_compute_dtype

        backend = current_backend()
        return cls("auto", backend, loaded_blas(), memory_budget, resolve_compute_dtype("auto", backend))


def load_draft_proposer(path: str, weights: DraftWeights = DraftWeights()) -> DraftProposer:
    """The draft model at ``path`` (checked by ``check_draft_model``), loaded as ``mlx_lm.load`` loads it (any
    mlx-lm architecture, quantized or not), its weights dense where the stage's would be: on the CPU and CUDA a
    quantized matmul is the slow path (``stage_model.choose_dense_weights`` with the stage's setting, backend
    and BLAS). Logs what its weights hold and what a token of its KV costs."""
    from mlx_lm.utils import dequantize_model, load_model

    from stage_worker.model.stage_model import choose_dense_weights

    model, _ = load_model(Path(path))
    quantized = [m for _, m in model.named_modules() if _is_quantized(m)]
    dense, why = choose_dense_weights(weights.dequantize, backend=weights.backend, blas=weights.blas,
                                      quantized=bool(quantized), dense_bytes=_dense_bytes(model, weights.dtype),
                                      memory_budget=weights.memory_budget)
    if dense:
        dequantize_model(model)
    # In the stage's compute dtype, as the stage's own weights (a bfloat16 matmul on the CPU is the slow path).
    model.set_dtype(weights.dtype, lambda d: mx.issubdtype(d, mx.floating))
    mx.eval(model.parameters())
    proposer = DraftProposer(model, few_shapes=weights.backend != "cpu", pad_keys=weights.backend == "cuda")
    log.info("draft model %s: weights %.2f GB %s (%s), KV %.1f KB per token of each speculating sequence", path,
             proposer.weight_bytes / 1e9, "dequantized" if dense else ("quantized" if quantized else "dense"), why,
             proposer.kv_bytes_per_token / 1e3)
    return proposer


def _is_quantized(module: nn.Module) -> bool:
    """A quantized Linear, Embedding or expert stack, as ``stage_model`` tells them."""
    return isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or (
        hasattr(module, "bits") and "scales" in module)


def _dense_bytes(model: nn.Module, dtype: mx.Dtype) -> int:
    """Bytes the weights would take dequantized to ``dtype``."""
    total = 0
    for _, module in model.named_modules():
        if _is_quantized(module):
            total += module.weight.size * 32 // module.bits * dtype.size  # codes straddle words: count by bits
        elif not list(module.children()):
            flat: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
            total += sum(array.nbytes for _, array in flat)
    return total


@dataclass(frozen=True)
class DraftTimings:
    """Where the draft's proposal rounds spent their time, all time (host seconds by ``time.perf_counter``).

    A round's phases: ``regroup`` (sequences joining or leaving the draft's batch: copies of their KV),
    ``catch_up`` (building the forwards that feed tokens the draft has not seen), ``steps`` (building the
    proposal steps), ``sync`` (waiting for the round's one evaluation and reading the proposals back: where
    the device's work on the graphs built before shows), ``host`` (the rest: comparing each sequence with
    what the draft holds, bookkeeping)."""

    rounds: int = 0
    rows: int = 0  # sequences proposed for, summed over rounds
    catch_up_forwards: int = 0
    catch_up_tokens: int = 0  # tokens fed by catch-up forwards (not their padding)
    regroup_s: float = 0.0
    catch_up_s: float = 0.0
    steps_s: float = 0.0
    sync_s: float = 0.0
    host_s: float = 0.0

    PHASES = ("regroup", "catch_up", "steps", "sync", "host")

    @property
    def seconds(self) -> float:
        return sum(getattr(self, f"{phase}_s") for phase in self.PHASES)

    def plus(self, other: DraftTimings) -> DraftTimings:
        return DraftTimings(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class _Clock:
    """One round's phases, each ended by ``lap``."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self.spent = dict.fromkeys(DraftTimings.PHASES, 0.0)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.spent[phase] += now - self._mark
        self._mark = now


@dataclass
class _Held:
    """What the draft holds of a sequence: its first ``confirmed`` tokens, then ``proposed`` (proposals it fed,
    not yet verified). Only the proposals are kept: the sequence's tokens never change, they only grow."""

    confirmed: int = 0
    proposed: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.confirmed + len(self.proposed)

    def shared_with(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the draft holds, never their last (whose logits give the first proposal);
        compares only the proposals held with the tokens after the confirmed ones."""
        if self.confirmed >= len(tokens):
            return len(tokens) - 1
        matched = 0
        for proposal, token in zip(self.proposed, tokens[self.confirmed:self.confirmed + len(self.proposed)]):
            if proposal != token:
                break
            matched += 1
        return min(self.confirmed + matched, len(tokens) - 1)


class DraftProposer:
    """Greedy proposals of an mlx-lm ``model``, batched across the sequences asked.

    The sequences of the last round keep their draft KV in one ``DraftBatch`` that lasts from round to round;
    a sequence not asked in a round (plain steps, a pause) leaves it for a batch of its own and joins again
    when asked (``_regroup``). Per sequence it knows how many of the sequence's tokens the draft holds and which
    proposals it fed after them (``_Held``). Asked for proposals, it first brings each sequence in step: the
    proposals held are compared with the tokens the target kept after the confirmed ones (only those: never the
    whole history), the positions after the shared part are dropped (rejected proposals roll back: host
    bookkeeping, ``DraftBatch.drop_last``), and the tokens the draft never saw (the prompt, the target's bonus
    token, tokens of plain steps) are fed (catch-up). The batch then runs the catch-up but its last token as
    one right-padded forward (``_catch_up``; a joiner with more than ``JOIN_CATCH_UP`` tokens to catch up, a
    new sequence's prompt, runs them first on its own batch), then one ``[B, 1]`` forward per proposal
    position, each row's input its previous argmax. The proposals and the KV are evaluated once at the end:
    one device sync per round, a long prompt's slices apart. A round copies none of the draft's KV unless
    sequences join or leave.

    The draft has no prefix cache: a sequence's first proposal prefills its whole prompt on the draft. It runs
    on the thread that calls the scheduler, the entry stage's model thread (MLX streams are per thread), inside
    the engine's lock as the scheduler does: a request submitted meanwhile waits for the draft's forwards.
    """

    def __init__(self, model: nn.Module, few_shapes: bool = False, pad_keys: bool = False) -> None:
        self.model = model
        self._pad_keys = pad_keys  # masked attention over whole buffers (``draft_batch.DraftBatch``): CUDA
        self._few_shapes = few_shapes  # catch-up widths padded to a few (``catch_up_width``): a GPU's kernels
        probe = make_prompt_cache(model)
        if any(type(cache) is not KVCache for cache in probe):
            raise DraftModelError(f"{FLAG}: the draft model's layers must all keep plain KV (mlx-lm's KVCache); "
                                  "use a Llama- or Qwen-like draft")
        self._layers = len(probe)
        flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        self.weight_bytes = sum(array.nbytes for _, array in flat)
        self.kv_bytes_per_token = _kv_bytes_per_token(model)
        self._timings = DraftTimings()
        self._held: dict[int, _Held] = {}
        self._batch: DraftBatch | None = None  # the sequences of the last round
        self._parked: dict[int, DraftBatch] = {}  # sequences not asked since (plain steps, a pause): one row each

    def take_timings(self) -> DraftTimings:
        """The rounds' timings since the last call (``DraftTimings``), the count started afresh."""
        timings, self._timings = self._timings, DraftTimings()
        return timings

    def propose(self, asks: Sequence[ProposalAsk]) -> dict[int, tuple[int, ...]]:
        asks = [ask for ask in asks if ask.k > 0 and ask.tokens]
        if not asks:
            return {}
        clock = _Clock()
        feeds: dict[int, tuple[int, ...]] = {}  # by seq_id: the tokens the draft has not seen, at least the last
        for ask in asks:
            held = self._held.setdefault(ask.seq_id, _Held())
            shared = held.shared_with(ask.tokens)
            place = self._batch_of(ask.seq_id)
            place.drop_last(place.row(ask.seq_id), held.tokens - shared)
            self._held[ask.seq_id] = _Held(shared)
            feeds[ask.seq_id] = ask.tokens[shared:]
        clock.lap("host")
        batch, forwards, fed = self._regroup([ask.seq_id for ask in asks], feeds, clock)
        by_row = [feeds[seq_id] for seq_id in batch.seq_ids]
        more_forwards, more_fed = self._catch_up(batch, [feed[:-1] for feed in by_row])
        clock.lap("catch_up")
        k = max(ask.k for ask in asks)
        step = mx.array([[feed[-1]] for feed in by_row])
        ones = [1] * len(by_row)
        proposed = []
        for _ in range(k):
            step = mx.argmax(batch.forward(self.model, step, ones)[:, -1, :], axis=-1, keepdims=True)
            proposed.append(step)
        drafts = mx.concatenate(proposed, axis=1)
        clock.lap("steps")
        mx.eval(drafts, batch.arrays())  # the round's one sync
        rows: list[list[int]] = drafts.tolist()  # type: ignore[assignment]
        clock.lap("sync")
        out: dict[int, tuple[int, ...]] = {}
        for ask in asks:
            row = batch.row(ask.seq_id)
            # Fed: the sequence, then every proposal but the last; a row asked for fewer than ``k`` drops the rest.
            batch.drop_last(row, k - ask.k)
            self._held[ask.seq_id] = _Held(len(ask.tokens), tuple(rows[row][:ask.k - 1]))
            out[ask.seq_id] = tuple(rows[row][:ask.k])
        clock.lap("host")
        self._timings = self._timings.plus(DraftTimings(
            1, len(asks), forwards + more_forwards, fed + more_fed,
            **{f"{phase}_s": spent for phase, spent in clock.spent.items()}))
        return out

    def release(self, seq_id: int) -> None:
        # A sequence still in the batch leaves it at the next round's regroup (no copy now); the batch goes
        # with its last sequence.
        self._held.pop(seq_id, None)
        self._parked.pop(seq_id, None)
        if self._batch is not None and not any(s in self._held for s in self._batch.seq_ids):
            self._batch = None

    def clear(self) -> None:
        self._held.clear()
        self._parked.clear()
        self._batch = None

    @property
    def held_sequences(self) -> int:
        return len(self._held)

    @property
    def batch_columns(self) -> int:
        """Columns the draft's batch spans per row (its tokens, plus holes not yet compacted away)."""
        return 0 if self._batch is None else self._batch.end

    def held_tokens(self, seq_id: int) -> int:
        """Positions the draft's caches hold for ``seq_id`` (0: none)."""
        held = self._held.get(seq_id)
        return held.tokens if held else 0

    def _batch_of(self, seq_id: int) -> DraftBatch:
        """Where ``seq_id``'s draft KV is: the batch, its parked row, or a new empty row (parked)."""
        if self._batch is not None and seq_id in self._batch.seq_ids:
            return self._batch
        if seq_id not in self._parked:
            self._parked[seq_id] = DraftBatch([seq_id], self._layers, pad_keys=self._pad_keys)
        return self._parked[seq_id]

    def _regroup(self, seq_ids: Sequence[int], feeds: dict[int, tuple[int, ...]],
                 clock: _Clock) -> tuple[DraftBatch, int, int]:
        """The batch of exactly ``seq_ids``: those of the last round stay where they are, the others leave
        (parked, or dropped once released), the asked ones not in it join; a joiner with a long catch-up (a
        new sequence's prompt) runs it before joining rather than making every row run its length. Returns
        the batch and the catch-up forwards and tokens run for joiners (their ``feeds`` cut to their last token)."""
        batch, asked = self._batch, set(seq_ids)
        staying = [] if batch is None else [row for row, seq_id in enumerate(batch.seq_ids) if seq_id in asked]
        if batch is not None and len(staying) < len(batch.seq_ids):
            for row, seq_id in enumerate(batch.seq_ids):
                if seq_id not in asked and seq_id in self._held:
                    self._parked[seq_id] = batch.take([row])
            batch = batch.take(staying) if staying else None
        in_batch = set() if batch is None else set(batch.seq_ids)
        joining = [seq_id for seq_id in seq_ids if seq_id not in in_batch]
        clock.lap("regroup")
        forwards = fed = 0
        long = [seq_id for seq_id in joining if len(feeds[seq_id]) - 1 > JOIN_CATCH_UP]
        if long:
            parked = [self._parked.pop(seq_id) for seq_id in long]
            alone = parked[0] if len(parked) == 1 else DraftBatch.concat(parked)
            forwards, fed = self._catch_up(alone, [feeds[seq_id][:-1] for seq_id in long])
            for seq_id in long:
                feeds[seq_id] = feeds[seq_id][-1:]
            self._parked.update({seq_id: alone for seq_id in long})
            clock.lap("catch_up")
        if joining:
            parts = [] if batch is None else [batch]
            for seq_id in joining:
                part = self._parked.pop(seq_id)
                if all(part is not other for other in parts):  # the long joiners share one batch
                    parts.append(part)
            batch = parts[0] if len(parts) == 1 else DraftBatch.concat(parts)
        assert batch is not None
        self._batch = batch
        clock.lap("regroup")
        return batch, forwards, fed

    def _catch_up(self, batch: DraftBatch, feeds: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Feed each row its ``feeds`` tokens (any length, none included), right-padded to the longest, or with
        ``few_shapes`` to one of a few widths (``catch_up_width``): a GPU then builds kernels for few shapes, where
        a CPU would only compute the padding. The forwards run and the tokens fed."""
        longest = max(len(feed) for feed in feeds)
        forwards = 0
        for start in range(0, longest, CATCH_UP_STEP):
            parts = [feed[start:start + CATCH_UP_STEP] for feed in feeds]
            longest_part = max(len(part) for part in parts)
            width = catch_up_width(longest_part) if self._few_shapes else longest_part
            tokens = mx.array([[*part, *([0] * (width - len(part)))] for part in parts])
            batch.forward(self.model, tokens, [len(part) for part in parts])  # the logits are never read
            forwards += 1
            if longest > CATCH_UP_STEP:
                mx.eval(batch.arrays())  # a long prompt's slices one at a time, as mlx-lm prefills
        return forwards, sum(len(feed) for feed in feeds)


def catch_up_width(longest: int) -> int:
    """The columns a catch-up of ``longest`` tokens runs as (pure): the next power of two up to 64, then the next
    multiple of 64, at most ``CATCH_UP_STEP``."""
    if longest <= 64:
        return 1 << max(0, longest - 1).bit_length()
    return min(CATCH_UP_STEP, -(-longest // 64) * 64)


def _kv_bytes_per_token(model: nn.Module) -> int:
    """What one position of one sequence costs in the draft's KV, from a one-token forward's caches."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in caches)


__all__ = ["DraftModelError", "DraftProposer", "DraftTimings", "DraftWeights", "check_draft_model",
           "load_draft_proposer"]
