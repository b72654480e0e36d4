"""Warm a stage's kernels at load, so the first users do not pay for compiling them.

MLX builds a GPU kernel the first time it meets an operation at a dtype and shape class (Metal: a pipeline per
kernel; CUDA: JIT-compiled kernels and cuBLAS plans per shape). So after its weights load and before it
reports SERVING, a stage runs its own slice on throwaway data the way serving will (``warm_up``): a prompt
chunk of the largest size the scheduler sends, then for each of a few decode batch sizes that many short
fresh prompts (batched as fresh prompts are) and one decode step of the group. It uses a throwaway
``StageCompute``: the stage's real one does not exist yet, and nothing here touches it. ``warmup_plan``
(pure) chooses the sizes (``WarmupPlan``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx

from stage_worker.batch import Chunk, RecordFlag, SequenceRecord
from stage_worker.engine.stage_runtime import EntryPipeline, StageCompute
from stage_worker.model.stage_model import StageModel

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
    """What to run at load (pure); see the module docstring. On the CPU one tiny prompt and one decode step
    of it (nothing to compile there; tests and CI start many stages); on a GPU the full prompt chunk and
    decode batches of 1 and the largest a batch carries (``--max-num-seqs`` over the micro-batches in flight,
    as the scheduler splits them)."""
    room = max(1, max_model_len - 1)  # a decode step needs one position after the prompt
    prompt = min(_DECODE_PROMPT_TOKENS, room)
    if backend == "cpu":
        # The decode group's one short prompt is the tiny prefill: two passes in all.
        return WarmupPlan(prefill_tokens=(), decode_batches=(1,), prompt_tokens=prompt)
    largest = largest_decode_batch(max_num_seqs, micro_batches)
    return WarmupPlan(prefill_tokens=(min(max_batch_tokens, room),), decode_batches=tuple(sorted({1, largest})),
                      prompt_tokens=prompt)


def warm_up(model: StageModel, plan: WarmupPlan, in_group: bool = False) -> None:
    """Run ``plan`` through ``model``'s slice against throwaway caches; every result is discarded.

    The first stage starts from its embedding and the last ends with its norm, head and sampling, as in
    serving. The batches go through ``StageCompute.forward`` / ``sample`` themselves, so the warm-up takes the
    paths serving takes (a lone decode on plain caches, a group on its batch cache). A single-stage pipeline
    (first and last) runs its decode groups through a throwaway ``EntryPipeline`` instead, as the engine
    does (``_entry_decode``), except in a tensor-parallel group (``in_group``): every worker of the group then
    runs the same batches one by one (a member has neither end), so their all-reduces pair up."""
    compute = StageCompute(model, max(plan.decode_batches, default=1))
    seq_ids = itertools.count(1)
    fresh = RecordFlag.NEW_SEQUENCE | RecordFlag.SAMPLE
    for tokens in plan.prefill_tokens:
        seq = next(seq_ids)
        _batch(compute, [SequenceRecord(seq, 0, tokens, fresh)])
        compute.kv.release(seq)
    prompt = plan.prompt_tokens
    single_stage = model.role.is_first and model.role.is_last and not in_group
    for size in plan.decode_batches:
        group = [next(seq_ids) for _ in range(size)]
        if single_stage:
            _entry_decode(compute, group, prompt)
        else:
            _batch(compute, [SequenceRecord(seq, 0, prompt, fresh) for seq in group])
            _batch(compute, [SequenceRecord(seq, prompt, 1, RecordFlag.SAMPLE) for seq in group])
        compute.kv.release_many(group)
    mx.clear_cache()  # the throwaway buffers go back; serving allocates its own


def _entry_decode(compute: StageCompute, group: list[int], prompt: int) -> None:
    """A single-stage pipeline's way: prompts, then a carried decode step queued before they are read: fed
    the tokens they sampled still on the device (``Chunk.carried``: its own gather kernel, which the first
    request would otherwise wait for NVRTC to compile)."""
    pipeline = EntryPipeline(compute, None, None, is_last=True)
    fresh = RecordFlag.NEW_SEQUENCE | RecordFlag.SAMPLE
    pipeline.submit([Chunk(SequenceRecord(seq, 0, prompt, fresh), (0,) * prompt) for seq in group])
    pipeline.submit([Chunk(SequenceRecord(seq, prompt, 1, RecordFlag.SAMPLE), (), carried=True) for seq in group])
    pipeline.collect()
    pipeline.collect()


def _batch(compute: StageCompute, records: list[SequenceRecord]) -> None:
    """One batch as serving runs it: this slice's layers, then (last stage) norm, head and sampling."""
    model = compute.model
    rows = sum(r.num_tokens for r in records)
    if model.role.is_first:
        hidden = model.embed(mx.zeros((rows,), dtype=mx.int32))
    else:
        # A fixed key: the warm-up must not move MLX's global random state.
        hidden = mx.random.normal((rows, model.hidden_size), dtype=model.dtype, key=mx.random.key(0))
    out = compute.forward(records, hidden, evaluate=not model.role.is_last)
    if model.role.is_last:
        compute.sample(records, out)
