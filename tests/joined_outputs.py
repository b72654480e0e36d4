"""Shared by the joined-projection tests: the batches a stage's compute runs them through, and the comparison.

``STEPS`` are the shapes of batch a stage meets: fresh prompts of similar length together and a long one alone;
a decode group beside a continued prompt and two new prompts; all decode; then one sequence alone, twice (a lone
decode is a one-row input). ``stage_outputs`` runs a loaded ``StageModel`` through them; ``assert_same_outputs``
compares two runs as the numerics of joined matmuls allow.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from stage_worker.batch import RecordFlag, SequenceRecord
from stage_worker.engine.stage_runtime import StageCompute

NEW = RecordFlag.NEW_SEQUENCE

# Each batch as (sequence, first position, tokens, flags).
STEPS = [
    [(0, 0, 6, NEW), (1, 0, 6, NEW), (2, 0, 4, NEW), (3, 0, 5, NEW), (6, 0, 30, NEW)],
    [(0, 6, 1, 0), (1, 6, 1, 0), (2, 4, 1, 0), (3, 5, 3, 0), (4, 0, 2, NEW), (5, 0, 2, NEW), (6, 30, 1, 0)],
    [(0, 7, 1, 0), (1, 7, 1, 0), (2, 5, 1, 0), (3, 8, 1, 0), (4, 2, 1, 0), (5, 2, 1, 0), (6, 31, 1, 0)],
    [(6, 32, 1, 0)],
    [(6, 33, 1, 0)],
]


def stage_outputs(model, steps: Sequence[Sequence[tuple[int, int, int, int]]] = STEPS) -> list[np.ndarray]:
    """The output rows of each batch of ``steps`` through ``model`` (a loaded ``StageModel``), in order."""
    vocab = model.spec.vocab_size
    compute = StageCompute(model, 16)
    outputs = []
    for batch in steps:
        records = [SequenceRecord(s, start, n, flags) for s, start, n, flags in batch]
        ids = [(s * 97 + 13 * p) % (vocab - 1) + 1 for s, start, n, _ in batch for p in range(start, start + n)]
        outputs.append(np.array(compute.forward(records, model.embed(mx.array(ids, dtype=mx.int32)))))
    return outputs


def assert_same_outputs(joined: list[np.ndarray], separate: list[np.ndarray],
                        steps: Sequence[Sequence[tuple[int, int, int, int]]] = STEPS) -> None:
    """The same dot products: identical with MLX's reference BLAS; an optimized BLAS (the one tests/conftest.py
    loads, as a stage does) may block a wider matrix differently, so the last bits may move."""
    from stage_worker.model.blas import loaded_blas

    exact = loaded_blas() == "reference"
    for step, (a, b) in enumerate(zip(joined, separate, strict=True)):
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=f"batch {step}: {steps[step]}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"batch {step}: {steps[step]}")
