"""Constrained decoding's tokenizer is built off the stage loop, once, and the grammar then constrains.

The serving last stage calls ``RowProcessors.prepare_grammars`` at start; the first constrained request must
find the llguidance tokenizer built (not build it again on the loop, which under load took long enough to trip
the neighbours' link watchdog) and the mask must allow exactly what the grammar allows.
"""

from __future__ import annotations

import llguidance
import mlx.core as mx
import numpy as np

from stage_worker.grammar import GrammarRows, apply
from stage_worker.model_reader import read_model_spec


def test_prepared_tokenizer_is_built_once_on_its_thread_and_constrains(default_model_path):
    spec = read_model_spec(default_model_path)
    rows = GrammarRows(spec)
    rows.prepare(spec.vocab_size)
    assert rows._preparing is not None
    rows._preparing.join(timeout=120)
    assert not rows._preparing.is_alive()
    built = rows._tokenizer
    assert built is not None

    grammar = llguidance.LLMatcher.grammar_from_regex("(yes|no)")
    rows.add(1, grammar, stop_token_ids=[2], vocab=spec.vocab_size)
    assert rows._tokenizer is built  # the request used the prepared tokenizer
    mask = rows.masks([1], spec.vocab_size)
    allowed = np.flatnonzero(np.array(apply(mx.zeros((1, spec.vocab_size)), mask)[0]) > -np.inf)
    from stage_worker.tokenizer import load_tokenizer

    texts = {load_tokenizer(spec).decode([int(t)]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert "y" in "".join(texts) and "n" in "".join(texts)
