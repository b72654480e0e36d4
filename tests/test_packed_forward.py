"""A packed batch (fresh prompts grouped by length, a continuing chunk, a decode group) computes
the same hidden states as each sequence alone, on the real model's first layers."""

import mlx.core as mx
import numpy as np
import pytest

from stage_worker.batch import RecordFlag, SequenceRecord
from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.engine.stage_runtime import StageCompute
from stage_worker.model.stage_model import StageModel, StageRole
from stagemesh_core.layer_split import LayerRange

NEW = RecordFlag.NEW_SEQUENCE


@pytest.fixture(scope="module")
def model():
    spec = read_model_spec(str(default_model_path()))
    return StageModel.load(spec, StageRole(LayerRange(0, 3), True, False), mx.float32)


def _tokens(seq_id, start, n):
    return [(seq_id * 97 + 13 * p) % 5000 + 1 for p in range(start, start + n)]


def _run(compute, model, batch):
    """batch: (seq_id, start, n, flags) per record; returns each record's output rows."""
    records = [SequenceRecord(s, start, n, flags) for s, start, n, flags in batch]
    ids = [t for s, start, n, _ in batch for t in _tokens(s, start, n)]
    out = np.array(compute.forward(records, model.embed(mx.array(ids, dtype=mx.int32))))
    rows, at = {}, 0
    for s, _, n, _ in batch:
        rows[s], at = out[at : at + n], at + n
    return rows


def test_fresh_prompts_group_by_similar_length():
    from stage_worker.model.packed_forward import Segment, fresh_prompt_groups

    class Empty:
        offset = 0

    def segment(n, row):
        return Segment([Empty()], n, row)

    segments = [segment(32, 0), segment(30, 32), segment(33, 62), segment(200, 95), segment(7, 295)]
    groups, alone = fresh_prompt_groups(segments)
    assert [[s.num_tokens for s in g.segments] for g in groups] == [[30, 32, 33]]
    assert groups[0].length == 33 and groups[0].real is not None
    assert sorted(s.num_tokens for s in alone) == [7, 200]


@pytest.mark.e2e
def test_packed_batches_equal_each_sequence_alone(model):
    steps = [
        # 0-3 are fresh prompts of similar length: one attention, 2 and 3 right-padded to 6 rows;
        # 6 is fresh but far longer (attends alone); 3 continues its prompt in the next batch
        [(0, 0, 6, NEW), (1, 0, 6, NEW), (2, 0, 4, NEW), (3, 0, 5, NEW), (6, 0, 30, NEW)],
        # 0-2 decode together; 3 continues its prompt; 4 and 5 arrive as fresh equal-length prompts
        [(0, 6, 1, 0), (1, 6, 1, 0), (2, 4, 1, 0), (3, 5, 3, 0), (4, 0, 2, NEW), (5, 0, 2, NEW), (6, 30, 1, 0)],
        [(0, 7, 1, 0), (1, 7, 1, 0), (2, 5, 1, 0), (3, 8, 1, 0), (4, 2, 1, 0), (5, 2, 1, 0), (6, 31, 1, 0)],
    ]
    packed = StageCompute(model, 16)
    alone = StageCompute(model, 16)
    for batch in steps:
        together = _run(packed, model, batch)
        for record in batch:
            reference = _run(alone, model, [record])[record[0]]
            np.testing.assert_allclose(together[record[0]], reference, rtol=1e-4, atol=1e-4,
                                       err_msg=f"sequence {record[0]} in batch {batch}")


@pytest.mark.e2e  # the real model's first layers
def test_chunks_over_a_whole_padded_buffer_equal_chunks_over_their_history(model):
    """``pad_keys`` (a stage on CUDA): a chunk of several rows continuing a history (a verification, a long
    prompt's later chunk) attends over its caches' whole buffer with the positions past its history masked,
    and computes what it computes over the history alone; a one-row step is left as it is."""
    steps = [[(0, 0, 20, NEW), (1, 0, 7, NEW)], [(0, 20, 5, 0), (1, 7, 1, 0)], [(0, 25, 3, 0), (1, 8, 4, 0)],
             [(0, 28, 1, 0), (1, 12, 6, 0)]]
    plain = StageCompute(model, 16)
    padded_model = StageModel(model.spec, model.role, model.dtype, model._module)
    padded_model.pad_keys = True
    padded = StageCompute(padded_model, 16)
    for batch in steps:
        expected = _run(plain, model, batch)
        got = _run(padded, padded_model, batch)
        for record in batch:
            # The same rows of the same history: only the matmul's length differs, by weights of exactly 0.
            np.testing.assert_allclose(got[record[0]], expected[record[0]], rtol=1e-5, atol=1e-5,
                                       err_msg=f"sequence {record[0]} in batch {batch}")


VERIFY = RecordFlag.VERIFY | RecordFlag.SAMPLE


@pytest.mark.e2e  # the real model's first layers
@pytest.mark.parametrize("pad_keys", [False, True], ids=["history", "whole-buffer"])
def test_verifications_in_the_decode_group_equal_each_sequence_alone_through_their_rollbacks(model, pad_keys):
    """Speculative verifications (several tokens) beside one-token decodes run as one right-padded group step,
    and rejected positions roll back inside the group (each sequence's next record starts before its KV's end):
    every row equals the sequence computed alone, on its own caches."""
    steps = [
        [(0, 0, 9, NEW), (1, 0, 4, NEW), (2, 0, 12, NEW)],
        [(0, 9, 5, VERIFY), (1, 4, 1, 0), (2, 12, 3, VERIFY)],
        # 0 kept 2 of its 5 positions, 2 kept all 3; 1 now verifies while 0 decodes
        [(0, 11, 1, 0), (1, 5, 4, VERIFY), (2, 15, 5, VERIFY)],
        # 1 kept 1 position, 2 kept 4: rolled back by different amounts in one step
        [(0, 12, 3, VERIFY), (1, 6, 1, 0), (2, 19, 1, 0)],
        [(0, 13, 1, 0), (1, 7, 1, 0), (2, 20, 1, 0)],  # plain decodes after the rollbacks
    ]
    grouped_model = StageModel(model.spec, model.role, model.dtype, model._module)
    grouped_model.pad_keys = pad_keys
    grouped = StageCompute(grouped_model, 16)
    alone = StageCompute(model, 16)
    for step, batch in enumerate(steps):
        together = _run(grouped, grouped_model, batch)
        if step:  # one group step, never a sequence taken out of its group to roll back
            assert len({id(grouped.kv._group_of.get(s)) for s in (0, 1, 2)}) == 1 and not grouped.kv._standalone
        for record in batch:
            reference = _run(alone, model, [record])[record[0]]
            np.testing.assert_allclose(together[record[0]], reference, rtol=1e-4, atol=1e-4,
                                       err_msg=f"sequence {record[0]} in batch {batch}")
    assert grouped.kv.tokens_held == alone.kv.tokens_held == 14 + 8 + 21
