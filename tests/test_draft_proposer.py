"""The draft model's proposer on tiny random models: its proposals are the draft's own greedy continuation
(mlx-lm's ``generate_step``) whatever the target kept before, batched across sequences of other lengths and
asked for different numbers of proposals; what it holds follows each sequence and goes when it leaves. And
the start check refuses a draft that cannot serve the target: no model there, another vocabulary, another
tokenizer, layers whose KV cannot drop positions."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.speculation.draft_proposer import (
    DraftModelError,
    DraftProposer,
    check_draft_model,
    load_draft_proposer,
)
from stage_worker.speculation.rules import ProposalAsk
from stagemesh.bench.random_checkpoint import write_random_checkpoint
from tests.architectures import TINY_CONFIGS, mlx_lm_greedy, tiny_checkpoint

PROMPTS = ((5, 6, 7, 8, 9, 5, 6, 7), (101, 102, 103), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17), (7,))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("draft")


@pytest.fixture(scope="module")
def tiny_llama(root):
    return tiny_checkpoint("llama", root)


def test_proposals_are_the_drafts_greedy_continuation_after_any_verification(tiny_llama):
    """Rounds of proposals for four sequences at once, each keeping a random share of its proposals plus the
    token the target would have sampled: every round's proposals are what the draft alone would generate
    next, so the rejected proposals left its KV and the kept and bonus tokens were caught up."""
    proposer = load_draft_proposer(tiny_llama)
    # The reference: the draft's own greedy tokens, the target here (what the target keeps is its greedy run).
    reference = mlx_lm_greedy(proposer.model, [list(p) for p in PROMPTS], 48)
    sequences = [list(p) for p in PROMPTS]
    rng = random.Random(0)
    rejected = 0
    for _ in range(8):
        wanted = [rng.randint(1, 4) for _ in sequences]
        proposals = proposer.propose([ProposalAsk(i, tuple(s), k) for i, (s, k) in enumerate(zip(sequences, wanted))])
        for i, sequence in enumerate(sequences):
            made = len(sequence) - len(PROMPTS[i])
            assert proposals[i] == tuple(reference[i][made:made + wanted[i]])
            assert proposer.held_tokens(i) == len(sequence) + wanted[i] - 1  # fed: all but the last proposal
            kept = rng.randint(0, wanted[i])
            rejected += wanted[i] - kept
            sequence += reference[i][made:made + kept + 1]
    assert rejected > 0
    # A sequence that did not speculate for a while (plain steps) catches up on everything it missed.
    made = len(sequences[0]) - len(PROMPTS[0])
    sequences[0] += reference[0][made:made + 5]
    assert proposer.propose([ProposalAsk(0, tuple(sequences[0]), 3)])[0] == tuple(reference[0][made + 5:made + 8])
    proposer.release(0)
    assert proposer.held_tokens(0) == 0 and proposer.held_sequences == len(PROMPTS) - 1
    proposer.clear()
    assert proposer.held_sequences == 0


@pytest.mark.parametrize(("few_shapes", "pad_keys"), [(False, False), (True, False), (True, True)],
                         ids=["exact-widths", "padded-widths", "padded-widths-and-keys"])
def test_sequences_joining_pausing_and_leaving_keep_the_drafts_greedy_continuation(tiny_llama, monkeypatch,
                                                                                     few_shapes, pad_keys):
    """The draft's batch lasts across rounds: sequences that skip rounds (plain steps, a pause) leave it and come
    back, a long prompt joins mid-run (caught up on its own, in slices), rows grow past their columns (holes
    compacted away), catch-ups run at their own widths or padded to a few, and masked forwards attend over every
    column the batch holds (both as on CUDA). Every round's proposals are still the draft's own greedy
    continuation."""
    from stage_worker.speculation import draft_batch, draft_proposer

    monkeypatch.setattr(draft_batch, "COLUMN_STEP", 16)  # columns run out every few rounds
    monkeypatch.setattr(draft_proposer, "CATCH_UP_STEP", 8)  # a long prompt's catch-up runs in slices
    proposer = DraftProposer(load_draft_proposer(tiny_llama).model, few_shapes=few_shapes, pad_keys=pad_keys)
    late = tuple(range(200, 240))  # 40 tokens: longer than a joiner catches up inside the batch
    prompts = [*PROMPTS, late]
    reference = mlx_lm_greedy(proposer.model, [list(p) for p in prompts], 80)
    sequences = [list(p) for p in PROMPTS]
    rng = random.Random(1)
    for round_ in range(14):
        if round_ == 4:
            sequences.append(list(late))
        asked = [i for i in range(len(sequences)) if rng.random() < 0.7] or [0]
        wanted = {i: rng.randint(1, 4) for i in asked}
        proposals = proposer.propose([ProposalAsk(i, tuple(sequences[i]), wanted[i]) for i in asked])
        for i, sequence in enumerate(sequences):
            made = len(sequence) - len(prompts[i])
            if i in asked:
                assert proposals[i] == tuple(reference[i][made:made + wanted[i]]), (round_, i)
                kept = rng.randint(0, wanted[i])
                sequence += reference[i][made:made + kept + 1]
            else:
                sequence += reference[i][made:made + 1]  # a plain step
    assert proposer.batch_columns < 2 * max(len(s) for s in sequences)  # holes did not pile up
    for i in range(len(sequences)):
        proposer.release(i)
    assert proposer.held_sequences == 0 and proposer.batch_columns == 0  # the batch went with its last sequence


def test_rejected_proposals_columns_are_compacted_away(tiny_llama, monkeypatch):
    """Each round writes four columns per row and keeps one token (the first proposal's, fed again as the
    sequence's last): three holes a round. Once the batch's columns run out it compacts instead of growing,
    and the proposals stay the draft's greedy continuation."""
    from stage_worker.speculation import draft_batch

    monkeypatch.setattr(draft_batch, "COLUMN_STEP", 16)
    proposer = load_draft_proposer(tiny_llama)
    reference = mlx_lm_greedy(proposer.model, [list(p) for p in PROMPTS[:2]], 24)
    sequences = [list(p) for p in PROMPTS[:2]]
    for _ in range(20):
        proposals = proposer.propose([ProposalAsk(i, tuple(s), 4) for i, s in enumerate(sequences)])
        for i, sequence in enumerate(sequences):
            made = len(sequence) - len(PROMPTS[i])
            assert proposals[i] == tuple(reference[i][made:made + 4])
            sequence.append(reference[i][made])
    # 20 rounds wrote 80 columns; holes compacted, the batch spans little more than its longest row.
    assert proposer.batch_columns <= max(len(s) for s in sequences) + 2 * draft_batch.COLUMN_STEP


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # a tied head, an untied one with biases
def test_the_planners_figures_for_a_draft_are_what_it_loads(architecture, tiny_llama, root):
    """The bytes the planner and the entry stage set aside for a draft (``model_facts.draft_facts``) are the
    loaded draft's: its weights, and a position of its KV, in the compute dtype (float32 on this CPU)."""
    from stage_worker.model.model_facts import draft_facts
    from stagemesh_core.speculative import DRAFT_MODEL, SpeculativeConfig

    path = tiny_checkpoint(architecture, root)
    config = SpeculativeConfig(4, method=DRAFT_MODEL, model=path, disable_by_batch_size=8)
    facts = draft_facts(config, read_model_spec(tiny_llama), max_num_seqs=6)
    proposer = load_draft_proposer(path)
    assert facts is not None
    assert facts.weight_bytes(4) == proposer.weight_bytes
    assert facts.kv_bytes_per_token(4) == proposer.kv_bytes_per_token
    assert (facts.sequences, facts.proposals) == (6, 4)  # --max-num-seqs bounds disable_by_batch_size
    assert draft_facts(None, read_model_spec(tiny_llama), 6) is None


def test_a_draft_sharing_the_vocabulary_passes_the_start_check(tiny_llama, root):
    target = read_model_spec(tiny_llama)
    assert check_draft_model(tiny_llama, target).path == tiny_llama
    assert check_draft_model(tiny_checkpoint("qwen3", root), target).model_type == "qwen3"


def test_a_missing_path_is_refused_naming_it(tiny_llama, root):
    target = read_model_spec(tiny_llama)
    with pytest.raises(DraftModelError, match="not an mlx-lm model directory") as error:
        check_draft_model(str(root / "nowhere"), target)
    assert "--speculative-config" in str(error.value) and "nowhere" in str(error.value)


def test_another_vocabulary_is_refused(tiny_llama, root):
    target = read_model_spec(tiny_llama)
    bigger = write_random_checkpoint({**TINY_CONFIGS["llama"], "vocab_size": TINY_CONFIGS["llama"]["vocab_size"] + 64},
                                     root / "bigger-vocab", dtype="float32")
    with pytest.raises(DraftModelError, match="vocab_size is 49216, the target's 49152"):
        check_draft_model(str(bigger), target)


def test_another_tokenizer_of_the_same_size_is_refused(tiny_llama, root):
    """Two tokens' ids swapped: the same vocab_size and number of tokens, another vocabulary."""
    swapped = root / "swapped-tokenizer"
    shutil.copytree(tiny_llama, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftModelError, match="tokenizer differs from the target's"):
        check_draft_model(str(swapped), read_model_spec(tiny_llama))


def test_a_draft_whose_layers_cannot_drop_positions_is_refused(tiny_llama, root):
    with pytest.raises(DraftModelError, match="cannot drop rejected proposals"):
        check_draft_model(tiny_checkpoint("gpt_oss", root), read_model_spec(tiny_llama))
