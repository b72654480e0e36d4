"""``grammar.GrammarRows`` on a tiny model's tokenizer: what a finished grammar leaves a row to sample."""

from __future__ import annotations

import numpy as np
import pytest

from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.sampling.grammar import GrammarRows
from tests.architectures import tiny_checkpoint


@pytest.fixture(scope="module")
def rows_and_tokens(tmp_path_factory):
    from llguidance import LLMatcher

    from stage_worker.checkpoint.tokenizer import load_tokenizer

    spec = read_model_spec(tiny_checkpoint("llama", tmp_path_factory.mktemp("grammar")))
    tokens = load_tokenizer(spec).encode("red.", add_special_tokens=False)
    return spec, LLMatcher.grammar_from_regex(r"red\."), tokens


def _allowed(bitmask_row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return {int(t) for t in np.flatnonzero(bits)}


@pytest.mark.parametrize("stop_token_ids", [(2,), ()], ids=["stop tokens", "ignore_eos"])
def test_a_finished_grammar_leaves_the_stop_tokens_or_the_eos_never_nothing(rows_and_tokens, stop_token_ids):
    spec, grammar, tokens = rows_and_tokens
    vocab = spec.vocab_size
    rows = GrammarRows(spec)
    rows.add(7, grammar, stop_token_ids, vocab)
    for token in tokens:
        rows.accept(7, token)
    rows.accept(7, 2)  # the grammar's end: its EOS (the tokenizer's end of text, id 2)
    allowed = _allowed(rows.masks([7], vocab)[0], vocab)
    assert allowed == {2}  # the request's stop token, or (ignoring EOS) the tokenizer's EOS: both 2 here
