"""Warm a stage's kernels at load, so the first users do not pay for compiling them.

MLX builds a GPU kernel the first time it meets an operation at a dtype and
shape class (Metal: a pipeline per kernel; CUDA: JIT-compiled kernels and
cuBLAS plans per shape), which can make a fresh stage's first requests take
seconds. So after its weights load and before it reports SERVING, a stage runs
its own slice on throwaway data the way serving will: a prompt chunk of the
largest size the scheduler sends, then for each of a few decode batch sizes
that many short fresh prompts (batched as fresh prompts are) and one decode
step of the group; the first stage starts from its embedding and the last ends
with its norm and head, as in serving. Every cache lives in a throwaway
``KVStore``: the stage's real one does not exist yet, and nothing here
touches it.

``warmup_plan`` (pure) chooses the sizes: on the CPU one tiny prompt and one
decode step of it (nothing to compile there; tests and CI start many stages), on a
GPU the full prompt chunk and decode batches of 1 and the largest a batch
carries (``--max-num-seqs`` over the micro-batches in flight, as the
scheduler splits them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx

from stage_worker.kv_store import KVStore
from stage_worker.packed_forward import DecodeRows, Segment
from stage_worker.stage_model import StageModel

_DECODE_PROMPT_TOKENS = 4  # prompt of each sequence in a decode warm-up group


@dataclass(frozen=True)
class WarmupPlan:
    prefill_tokens: tuple[int, ...]  # one throwaway prompt chunk of each length
    decode_batches: tuple[int, ...]  # one decode step for a group of each size
    prompt_tokens: int = _DECODE_PROMPT_TOKENS  # each decode group's prompts, before its decode step

    def summary(self) -> str:
        chunks = f"a {' and '.join(map(str, self.prefill_tokens))}-token prompt chunk, " if self.prefill_tokens else ""
        return (f"{chunks}decode batches of {' and '.join(map(str, self.decode_batches))} after "
                f"{self.prompt_tokens}-token prompts")


def largest_decode_batch(max_num_seqs: int, micro_batches: int) -> int:
    """Sequences one batch decodes at most: the running ones split over the micro-batches in flight
    (``Scheduler.next_batch`` gives each batch ``ceil(running / micro_batches)``)."""
    return max(1, -(-max_num_seqs // max(1, micro_batches)))


def warmup_plan(backend: str, *, max_num_seqs: int, micro_batches: int, max_batch_tokens: int,
                max_model_len: int) -> WarmupPlan:
    """What to run at load (pure); see the module docstring."""
    room = max(1, max_model_len - 1)  # a decode step needs one position after the prompt
    prompt = min(_DECODE_PROMPT_TOKENS, room)
    if backend == "cpu":
        # The decode group's one short prompt is the tiny prefill: two passes in all.
        return WarmupPlan(prefill_tokens=(), decode_batches=(1,), prompt_tokens=prompt)
    largest = largest_decode_batch(max_num_seqs, micro_batches)
    return WarmupPlan(prefill_tokens=(min(max_batch_tokens, room),), decode_batches=tuple(sorted({1, largest})),
                      prompt_tokens=prompt)


def warm_up(model: StageModel, plan: WarmupPlan) -> None:
    """Run ``plan`` through ``model``'s slice against throwaway caches; every result is discarded."""
    store = KVStore(model.new_caches, max(plan.decode_batches, default=1))
    seq_ids = itertools.count()
    for tokens in plan.prefill_tokens:
        seq = next(seq_ids)
        segment = Segment(store.for_chunk(seq, 0, True, tokens), tokens)
        _finish(model, model.run_packed(_rows(model, tokens), [segment]), last_rows=[tokens - 1])
        store.release(seq)
    prompt = plan.prompt_tokens
    for size in plan.decode_batches:
        group = [next(seq_ids) for _ in range(size)]
        segments = [Segment(store.for_chunk(seq, 0, True, prompt), prompt, i * prompt) for i, seq in enumerate(group)]
        _finish(model, model.run_packed(_rows(model, size * prompt), segments),
                last_rows=[(i + 1) * prompt - 1 for i in range(size)])
        decode = DecodeRows(list(range(size)), store.for_decode(group, [prompt] * size))
        _finish(model, model.run_packed(_rows(model, size), [], decode), last_rows=list(range(size)))
        for seq in group:
            store.release(seq)
    mx.clear_cache()  # the throwaway buffers go back; serving allocates its own


def _rows(model: StageModel, count: int) -> mx.array:
    """``[count, hidden]`` input rows: token 0's embedding on the first stage, noise on the others."""
    if model.role.is_first:
        return model.embed(mx.zeros((count,), dtype=mx.int32))
    # A fixed key: the warm-up must not move MLX's global random state.
    return mx.random.normal((count, model.hidden_size), dtype=model.dtype, key=mx.random.key(0))


def _finish(model: StageModel, hidden: mx.array, last_rows: list[int]) -> None:
    """Evaluate the slice's output; the last stage also runs its head on the rows serving would sample."""
    if model.role.is_last:
        mx.eval(hidden, mx.argmax(model.logits(hidden[mx.array(last_rows)]), axis=-1))
    else:
        mx.eval(hidden)
