"""Speculative decoding through real pipelines gives, token for token, what the same greedy (and seeded
sampled) requests give without it: at PP=1, 2 and 3 (stages on threads joined by real lanes), a request alone
and requests of other lengths batched with it, next to requests that do not speculate (a repetition penalty,
logprobs), with a stop token and max_tokens cutting an accepted run. The workload repeats itself (prompts
with repeated phrases, greedy loops), so proposals are often right and often wrong: the counters must show
both, i.e. every stage dropped rejected positions and kept going.

The fast tier runs a tiny random llama (``tests/architectures.py``), proposals from prompt lookup and from a
draft model (the target's own weights, nearly always right; another model sharing its vocabulary, mostly
wrong). The e2e tier runs the real default model at PP=1 and 3 (PP=2: through ``stagemesh serve`` in
tests/e2e/test_speculative_serve_e2e.py), and at PP=2 as its own draft, with a smaller batch and without the
stop-token case, which the tiny model covers: the real model computes slowly on the CPU backend without the
optimized BLAS a stage preloads.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from stage_worker.model_reader import read_model_spec
from stage_worker.prefix_cache import PrefixCache
from stage_worker.stage_model import StageModel, StageRole, runs_packed
from stagemesh.core.layer_split import LayerRange, even_split
from stagemesh.core.sampling import GREEDY, SamplingParams
from stagemesh.core.speculative import SpeculativeConfig
from tests.architectures import tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, as_served, read_until_finished

SPECULATIVE = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                                disable_by_batch_size=8)
# Repeated phrases, so the prompt itself offers proposals, right or wrong.
REPEATING = (5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7)
OTHERS = (
    (101, 102, 103, 101, 102, 103, 101, 102),
    (504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    (1, 2, 3),
)
NOT_SPECULATING = (SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0, logprobs=1))
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7)  # speculates: each row draws as without


def _stages(path: str, depth: int, dtype=mx.float32) -> list[StageModel]:
    spec = read_model_spec(path)
    ranges = even_split(spec.num_layers, depth)
    return [as_served(StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), dtype))
            for i, r in enumerate(ranges)]


def _workload(pipeline: InProcessPipeline, repeating, max_tokens: int, small: bool = False,
              seeded: bool = True) -> dict[str, list]:
    """``repeating`` alone, then batched with others (``small``: one greedy and one not speculating, no seeded
    sampling; ``seeded``: with a seeded sampled request when not ``small``)."""
    others, not_speculating = (OTHERS[1:2], NOT_SPECULATING[:1]) if small else (OTHERS, NOT_SPECULATING)
    alone = [pipeline.generate(repeating, max_tokens)]
    batched_handles = [pipeline.submit(p, max_tokens - 3 * i) for i, p in enumerate((repeating, *others))]
    batched_handles += [pipeline.submit(OTHERS[0], max_tokens, sampling=s) for s in not_speculating]
    if seeded and not small:
        batched_handles.append(pipeline.submit(repeating, max_tokens, sampling=SEEDED))
    batched, _ = read_until_finished(batched_handles)
    return {"alone": alone, "batched": batched}


def _stop_token_case(pipeline: InProcessPipeline, repeating, reference: list[int], max_tokens: int) -> list[int]:
    """A stop token inside what a verification may accept: the output ends right there, as without it."""
    handle = pipeline.submit(repeating, max_tokens, stop_token_ids={reference[len(reference) // 2]})
    return read_until_finished([handle])[0][0]


def _check_identity(path: str, depths, max_tokens: int, dtype=mx.float32, stop_case: bool = True,
                    small: bool = False, repeating=REPEATING) -> None:
    """Speculating pipelines of each depth against one plain PP=1 pipeline (every depth computes the same greedy
    tokens without speculation: tests/test_architectures.py), both with the prefix cache on, as served."""
    with InProcessPipeline(_stages(path, 1, dtype), prefix_cache=PrefixCache(8, b"test")) as plain:
        expected = _workload(plain, repeating, max_tokens, small)
        stop = expected["alone"][0][len(expected["alone"][0]) // 2]
        expected_stop = _stop_token_case(plain, repeating, expected["alone"][0], max_tokens) if stop_case else None
    if stop_case:
        assert expected_stop == expected["alone"][0][:expected["alone"][0].index(stop) + 1]
    for depth in depths:
        with InProcessPipeline(_stages(path, depth, dtype), speculative=SPECULATIVE,
                               prefix_cache=PrefixCache(8, b"test")) as speculating:
            got = _workload(speculating, repeating, max_tokens, small)
            got_stop = _stop_token_case(speculating, repeating, expected["alone"][0], max_tokens) \
                if stop_case else None
            counts = speculating.scheduler.spec_decode.counts
        assert got == expected, f"PP={depth}: speculation changed greedy tokens"
        assert got_stop == expected_stop, f"PP={depth}: a stop token inside an accepted run"
        assert counts.accepted_tokens > 0, f"PP={depth}: no proposal was ever accepted: {counts}"
        assert counts.accepted_tokens < counts.draft_tokens, f"PP={depth}: no proposal was ever rejected: {counts}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("speculative")


@pytest.fixture(scope="module")
def tiny_llama(checkpoints):
    return tiny_checkpoint("llama", checkpoints)


def test_speculation_keeps_greedy_tokens_on_a_tiny_llama(tiny_llama):
    _check_identity(tiny_llama, (1, 2, 3), max_tokens=24)


def test_speculation_keeps_greedy_tokens_on_the_layer_stack_path(checkpoints):
    """DeepSeek V3's MLA runs mlx-lm's own layers over a stack of caches (not the packed forward): its latent
    KV caches drop rejected positions alike."""
    path = tiny_checkpoint("deepseek_v3", checkpoints)
    assert not runs_packed(read_model_spec(path))
    _check_identity(path, (1, 2), max_tokens=16, stop_case=False)


def test_requests_speculation_cannot_honour_run_without_it(tiny_llama):
    with InProcessPipeline(_stages(tiny_llama, 1), speculative=SPECULATIVE) as pipeline:
        for sampling in NOT_SPECULATING:
            read_until_finished([pipeline.submit(REPEATING, 16, sampling=sampling)])
        assert pipeline.scheduler.spec_decode.counts.drafts == 0
        pipeline.generate(REPEATING, 16)
        assert pipeline.scheduler.spec_decode.counts.drafts > 0


@pytest.mark.e2e
def test_speculation_keeps_greedy_tokens_on_the_default_model():
    from stage_worker.default_model import default_model_path
    from stage_worker.tokenizer import load_tokenizer

    path = str(default_model_path())
    # Text the model goes on repeating once it has seen it a few times, and not from its first token.
    text = "red green blue yellow, red green blue yellow, red green blue yellow, red green"
    repeating = tuple(load_tokenizer(read_model_spec(path)).encode(text))
    # PP=2 of the real model: tests/e2e/test_speculative_serve_e2e.py, through stagemesh serve.
    _check_identity(path, (1, 3), max_tokens=12, stop_case=False, small=True, repeating=repeating)


assert GREEDY.greedy  # the requests above without ``sampling`` are greedy


def test_seeded_sampling_speculates_and_keeps_its_tokens(tiny_llama):
    """Each verified row is drawn with the request's (seed, position) key, as without speculation: the same
    tokens, and proposals accepted where the draw agrees with them."""
    sampling = SamplingParams(temperature=0.3, top_k=40, seed=11)
    with InProcessPipeline(_stages(tiny_llama, 1)) as plain:
        expected = read_until_finished([plain.submit(REPEATING, 24, sampling=sampling)])[0]
    with InProcessPipeline(_stages(tiny_llama, 2), speculative=SPECULATIVE) as speculating:
        got = read_until_finished([speculating.submit(REPEATING, 24, sampling=sampling)])[0]
        counts = speculating.scheduler.spec_decode.counts
    assert got == expected
    assert 0 < counts.accepted_tokens < counts.draft_tokens, counts


# -- a draft model's proposals ------------------------------------------------------------------------------
def _check_draft_identity(path: str, draft_path: str, depths, max_tokens: int, *, own_weights: bool,
                          small: bool = False, repeating=REPEATING) -> None:
    """Speculating with the draft model at ``draft_path`` (loaded as a stage loads it) against one plain PP=1
    pipeline: the same tokens; with the target's own weights as the draft nearly every proposal is accepted
    (greedy requests only: a sampled row may draw another token than the draft's argmax), with another model
    most are rejected (the target's and the draft's KV both roll back)."""
    from stage_worker.draft_proposer import load_draft_proposer

    with InProcessPipeline(_stages(path, 1), prefix_cache=PrefixCache(8, b"test")) as plain:
        expected = _workload(plain, repeating, max_tokens, small, seeded=not own_weights)
    config = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model=draft_path,
                               disable_by_batch_size=8)
    for depth in depths:
        proposer = load_draft_proposer(draft_path)
        with InProcessPipeline(_stages(path, depth), speculative=config, prefix_cache=PrefixCache(8, b"test"),
                               proposer=proposer) as speculating:
            got = _workload(speculating, repeating, max_tokens, small, seeded=not own_weights)
            counts = speculating.scheduler.spec_decode.counts
        assert got == expected, f"PP={depth}: speculation with a draft model changed greedy tokens"
        assert proposer.held_sequences == 0, "a finished sequence's draft KV was kept"
        assert counts.drafts > 0, f"PP={depth}: nothing was verified: {counts}"
        if own_weights:
            assert counts.accepted_tokens >= 0.9 * counts.draft_tokens, f"PP={depth}: {counts}"
        else:
            assert counts.accepted_tokens < counts.draft_tokens / 2, f"PP={depth}: {counts}"


def test_a_draft_model_of_the_targets_own_weights_keeps_greedy_tokens_and_is_nearly_always_right(tiny_llama):
    _check_draft_identity(tiny_llama, tiny_llama, (1, 2), max_tokens=24, own_weights=True)


def test_a_different_draft_model_keeps_greedy_tokens_through_its_rejections(tiny_llama, checkpoints):
    """Another random model sharing the vocabulary: its proposals are mostly wrong, so both the stages' KV and
    the draft's roll back at nearly every verification, and the sequence pauses and catches up."""
    _check_draft_identity(tiny_llama, tiny_checkpoint("qwen3", checkpoints), (1, 2), max_tokens=24,
                          own_weights=False)


@pytest.mark.e2e
def test_the_default_model_as_its_own_draft_keeps_greedy_tokens(tmp_path):
    """The stages read the package's GGUF; the draft, loaded as mlx-lm loads a model, its conversion."""
    from stage_worker.convert import convert_gguf_to_mlx_dir
    from stage_worker.default_model import default_model_path
    from stage_worker.draft_proposer import check_draft_model
    from stage_worker.tokenizer import load_tokenizer

    path = str(default_model_path())
    draft = convert_gguf_to_mlx_dir(path, str(tmp_path / "draft"))
    check_draft_model(draft, read_model_spec(path))
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    prompt = tuple(load_tokenizer(read_model_spec(path)).encode(text))
    _check_draft_identity(path, draft, (2,), max_tokens=12, own_weights=True, small=True, repeating=prompt)
