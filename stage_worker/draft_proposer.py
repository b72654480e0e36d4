"""A draft model's proposals (vLLM's ``draft_model`` method): a small mlx-lm model on the entry stage.

Contract:
- ``check_draft_model(path, target)`` is the start check: ``path`` must be an mlx-lm model directory
  (config.json, weights) whose ``vocab_size`` and tokenizer (every token's id) equal the target's, and whose
  layers all keep plain KV (positions it can drop); anything else raises ``DraftModelError`` naming what to
  change. ``load_draft_proposer(path, weights)`` loads it as ``mlx_lm.load`` does (any mlx-lm architecture,
  quantized or not), in the stage's compute dtype, and runs a quantized draft with dense weights where the
  stage would run its own so (``DraftWeights``: ``stage_model.choose_dense_weights`` with the stage's setting,
  backend and BLAS), and logs what its weights hold and what a token of its KV costs.
- ``DraftProposer`` is a ``speculation.Proposer``. Each sequence has its own KV caches (mlx-lm's
  ``KVCache``, one per layer) and the tokens they hold. Asked for proposals, it first brings each sequence's
  caches in step with the sequence: the positions after the longest prefix it shares with what the target
  kept are dropped (rejected proposals roll back), then the tokens the draft never saw (the prompt, the
  target's bonus token, tokens of plain steps) are fed (catch-up). The asked sequences then run as one
  batch: their caches merged into mlx-lm's ``BatchKVCache`` (left padding, per-row offsets), the catch-up
  but its last token as one right-padded forward (as mlx-lm's ``BatchGenerator`` prefills), then one
  ``[B, 1]`` forward per proposal position, each row's input its previous argmax (greedy drafts); the
  proposals are evaluated once at the end. Each row's caches are then extracted back into its own.
- Greedy drafts make the last stage's acceptance exact for greedy and seeded requests alike
  (``speculation.accept_proposals``). The draft has no prefix cache: a sequence's first proposal prefills
  its whole prompt on the draft.
- It runs on the thread that calls the scheduler, the entry stage's model thread (MLX streams are per thread),
  inside the engine's lock as the scheduler does: a request submitted meanwhile waits for the draft's forwards.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from stage_worker.model_reader import ModelSpec, read_model_spec
from stage_worker.speculation import ProposalAsk
from stagemesh.core.errors import UserError
from stagemesh.core.speculative import FLAG

log = logging.getLogger(__name__)

# Catch-up tokens per forward: a long prompt's prefill on the draft runs in slices, as mlx-lm prefills.
CATCH_UP_STEP = 512


class DraftModelError(UserError):
    """A draft model that cannot propose for this target; the message names what to change."""


def check_draft_model(path: str, target: ModelSpec, target_tokenizer: Any | None = None) -> ModelSpec:
    """The draft at ``path`` as a spec, once it is an mlx-lm model directory sharing ``target``'s vocabulary."""
    from stage_worker.model_reader import ModelFormatError
    from stage_worker.tokenizer import load_tokenizer

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


def load_draft_proposer(path: str, weights: DraftWeights = DraftWeights()) -> DraftProposer:
    """The draft model at ``path`` (checked by ``check_draft_model``), loaded as ``mlx_lm.load`` loads it, its
    weights dense where the stage's would be: on the CPU and CUDA a quantized matmul is the slow path."""
    from mlx_lm.utils import dequantize_model, load_model

    from stage_worker.stage_model import choose_dense_weights

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
    proposer = DraftProposer(model)
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
    """A sequence's draft caches (one per layer) and the tokens they hold."""

    caches: list[Any]
    tokens: list[int] = field(default_factory=list)


class DraftProposer:
    """Greedy proposals of an mlx-lm ``model``, batched across the sequences asked (see the module's contract)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._held: dict[int, _Held] = {}
        probe = make_prompt_cache(model)
        if any(type(cache) is not KVCache for cache in probe):
            raise DraftModelError(f"{FLAG}: the draft model's layers must all keep plain KV (mlx-lm's KVCache); "
                                  "use a Llama- or Qwen-like draft")
        flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        self.weight_bytes = sum(array.nbytes for _, array in flat)
        self.kv_bytes_per_token = _kv_bytes_per_token(model)
        self._timings = DraftTimings()

    def take_timings(self) -> DraftTimings:
        """The rounds' timings since the last call (``DraftTimings``), the count started afresh."""
        timings, self._timings = self._timings, DraftTimings()
        return timings

    def propose(self, asks: Sequence[ProposalAsk]) -> dict[int, tuple[int, ...]]:
        asks = [ask for ask in asks if ask.k > 0 and ask.tokens]
        if not asks:
            return {}
        clock = _Clock()
        held = [self._in_step(ask) for ask in asks]
        feeds = [ask.tokens[len(h.tokens):] for ask, h in zip(asks, held)]  # at least the last token each
        clock.lap("host")
        # One sequence runs on its own caches; several on batch caches merged from theirs (copies of the draft's
        # KV, extracted back below), as mlx-lm's BatchGenerator joins sequences with a history.
        alone = len(held) == 1
        caches = held[0].caches if alone else \
            [BatchKVCache.merge([h.caches[layer] for h in held]) for layer in range(len(held[0].caches))]
        clock.lap("regroup")
        forwards, fed = self._catch_up(caches, [feed[:-1] for feed in feeds])
        clock.lap("catch_up")
        k = max(ask.k for ask in asks)
        step = mx.array([[feed[-1]] for feed in feeds])
        proposed = []
        for _ in range(k):
            step = mx.argmax(self.model(step, cache=caches)[:, -1, :], axis=-1, keepdims=True)
            proposed.append(step)
        drafts = mx.concatenate(proposed, axis=1)
        clock.lap("steps")
        mx.eval(drafts, [c.state for c in caches])
        rows: list[list[int]] = drafts.tolist()  # type: ignore[assignment]
        clock.lap("sync")
        if not alone:
            for b, h in enumerate(held):
                for layer, cache in enumerate(caches):
                    h.caches[layer] = cache.extract(b)
            clock.lap("regroup")
        out: dict[int, tuple[int, ...]] = {}
        for b, (ask, h) in enumerate(zip(asks, held)):
            # Fed: the sequence, then every proposal but the last; a row asked for fewer than ``k`` drops the rest.
            h.tokens = [*ask.tokens, *rows[b][:k - 1]]
            surplus = k - ask.k
            if surplus:
                for cache in h.caches:
                    cache.trim(surplus)
                del h.tokens[len(h.tokens) - surplus:]
            out[ask.seq_id] = tuple(rows[b][:ask.k])
        clock.lap("host")
        self._timings = self._timings.plus(DraftTimings(
            1, len(asks), forwards, fed, **{f"{phase}_s": spent for phase, spent in clock.spent.items()}))
        return out

    def release(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def clear(self) -> None:
        self._held.clear()

    @property
    def held_sequences(self) -> int:
        return len(self._held)

    def held_tokens(self, seq_id: int) -> int:
        """Positions the draft's caches hold for ``seq_id`` (0: none)."""
        held = self._held.get(seq_id)
        return len(held.tokens) if held else 0

    def _in_step(self, ask: ProposalAsk) -> _Held:
        """``ask``'s sequence's caches, cut back to the longest prefix they share with its tokens, and never
        past its last token (whose logits give the first proposal)."""
        held = self._held.get(ask.seq_id)
        if held is None:
            held = self._held[ask.seq_id] = _Held(make_prompt_cache(self.model))
        shared = _shared_prefix(held.tokens, ask.tokens)
        shared = min(shared, len(ask.tokens) - 1)
        drop = len(held.tokens) - shared
        if drop:
            for cache in held.caches:
                cache.trim(drop)
            del held.tokens[shared:]
        return held

    def _catch_up(self, caches: list[Any], feeds: Sequence[Sequence[int]]) -> tuple[int, int]:
        """Feed each row its ``feeds`` tokens (any length, none included), right-padded to the longest, then
        the padding moved to the left where the batch cache masks it (``BatchKVCache.finalize``); the
        forwards run and the tokens fed."""
        longest = max(len(feed) for feed in feeds)
        if longest == 0:
            return 0, 0
        padding = [longest - len(feed) for feed in feeds]
        tokens = mx.array([[*feed, *([0] * pad)] for feed, pad in zip(feeds, padding)])
        if max(padding):
            for cache in caches:
                cache.prepare(right_padding=padding)
        for start in range(0, longest, CATCH_UP_STEP):
            self.model(tokens[:, start:start + CATCH_UP_STEP], cache=caches)
            mx.eval([c.state for c in caches])  # the logits are never read: only the caches are computed
        if max(padding):
            for cache in caches:
                cache.finalize()
        return -(-longest // CATCH_UP_STEP), sum(len(feed) for feed in feeds)


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # a list and a tuple never compare equal
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _kv_bytes_per_token(model: nn.Module) -> int:
    """What one position of one sequence costs in the draft's KV, from a one-token forward's caches."""
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in caches)


__all__ = ["DraftModelError", "DraftProposer", "DraftTimings", "DraftWeights", "check_draft_model",
           "load_draft_proposer"]
