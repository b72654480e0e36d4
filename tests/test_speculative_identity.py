"""Speculative decoding through real pipelines gives, token for token, what the same greedy (and seeded
sampled) requests give without it: at PP=1, 2 and 3 (stages on threads joined by real lanes), a request alone
and requests of other lengths batched with it, with a stop token and max_tokens cutting an accepted run. Every
request option speculates and keeps its meaning: logprobs (each token's own, equal within float rounding),
the three penalties, logit bias and allowed tokens, min_p with a seed, min_tokens and a grammar, alone and
batched with plain requests, each verified (the counters move for it). The workload repeats itself (prompts
with repeated phrases, greedy loops), so proposals are often right and often wrong: the counters must show
both, i.e. every stage dropped rejected positions and kept going.

The fast tier runs a tiny random llama (``tests/architectures.py``), proposals from prompt lookup and from a
draft model (the target's own weights, nearly always right; another model sharing its vocabulary, mostly
wrong). The e2e tier runs the real default model at PP=1 and 3 (PP=2: through ``stagemesh serve`` in
tests/e2e/test_speculative_serve_e2e.py), and at PP=2 as its own draft, with a smaller batch and without the
stop-token case, which the tiny model covers: each token of the real model costs about a tenth of a CPU-second.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.model.stage_model import StageModel, StageRole, runs_packed
from stagemesh_core.layer_split import LayerRange, even_split
from stagemesh_core.sampling import GREEDY, SamplingParams
from stagemesh_core.speculative import SpeculativeConfig
from tests.architectures import tiny_checkpoint
from tests.engine_helpers import InProcessPipeline, as_served, read_until_finished, read_with_logprobs

SPECULATIVE = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                                disable_by_batch_size=8)
# Repeated phrases, so the prompt itself offers proposals, right or wrong.
REPEATING = (5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7)
OTHERS = (
    (101, 102, 103, 101, 102, 103, 101, 102),
    (504, 3575, 282, 4649, 314, 1018, 28, 2270, 253, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24),
    (1, 2, 3),
)
# Requests with options, batched beside the others (they speculate too).
WITH_OPTIONS = (SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0, logprobs=1))
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=7)  # speculates: each row draws as without


def _stages(path: str, depth: int, dtype=mx.float32) -> list[StageModel]:
    spec = read_model_spec(path)
    ranges = even_split(spec.num_layers, depth)
    return [as_served(StageModel.load(spec, StageRole(LayerRange(r.start, r.end), i == 0, i == depth - 1), dtype))
            for i, r in enumerate(ranges)]


def _workload(pipeline: InProcessPipeline, repeating, max_tokens: int, small: bool = False,
              all_options: bool = True) -> dict[str, list]:
    """``repeating`` alone, then batched with others (``small``: one greedy and one with options, no seeded
    sampling; ``all_options``: with the penalized request and, when not ``small``, a seeded sampled one; else only
    requests whose target tokens are the argmax of the unprocessed logits)."""
    others = OTHERS[1:2] if small else OTHERS
    with_options = WITH_OPTIONS if all_options else WITH_OPTIONS[1:]
    with_options = with_options[:1] if small else with_options
    alone = [pipeline.generate(repeating, max_tokens)]
    batched_handles = [pipeline.submit(p, max_tokens - 3 * i) for i, p in enumerate((repeating, *others))]
    batched_handles += [pipeline.submit(OTHERS[0], max_tokens, sampling=s) for s in with_options]
    if all_options and not small:
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


# -- every request option ----------------------------------------------------------------------------------
EOS = 2  # the tokenizer's end of text: the grammar's end, and min_tokens' stop below
# Greedy unless said: each option alone, logprobs beside most, so each token's own logprobs are compared too.
OPTIONS = {
    "logprobs": SamplingParams(temperature=0.0, logprobs=3),
    "penalties": SamplingParams(temperature=0.0, presence_penalty=0.1, frequency_penalty=0.05, repetition_penalty=1.05,
                                logprobs=2),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias=((6, 2.0), (9, -1.0)),
                                 allowed_token_ids=(5, 6, 7, 8, 9, 101, 102), logprobs=1),
    "min_p": SamplingParams(temperature=0.7, min_p=0.6, seed=5, logprobs=1),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=10, logprobs=0),
    "grammar": SamplingParams(temperature=0.0, logprobs=2, grammar=""),  # the regex below, compiled
}
# Words of the tiny model's vocabulary, any number, then a period: a random model loops inside it.
REGEX = r"(red|green|blue|yellow)( (red|green|blue|yellow))*\."


def _options() -> dict[str, SamplingParams]:
    from dataclasses import replace

    from llguidance import LLMatcher

    return {**OPTIONS, "grammar": replace(OPTIONS["grammar"], grammar=LLMatcher.grammar_from_regex(REGEX))}


Output = tuple[list[int], list]  # a request's tokens and their logprobs


def _options_workload(pipeline: InProcessPipeline, options: dict[str, SamplingParams], prompt,
                      max_tokens: int) -> tuple[dict[str, Output], list[Output], dict[str, tuple[int, int]]]:
    """Each option's request alone (and the verifications it had and the proposals they accepted), then all of
    them batched with two plain greedy requests. min_tokens' and the grammar's requests end at EOS; the others
    ignore it."""
    alone: dict[str, Output] = {}
    verified: dict[str, tuple[int, int]] = {}
    stops = {"min_tokens": {EOS}, "grammar": {EOS}}
    for name, sampling in options.items():
        before = pipeline.scheduler.spec_decode.counts
        handle = pipeline.submit(prompt, max_tokens, sampling, stops.get(name, frozenset()))
        (alone[name],) = read_with_logprobs([handle])
        after = pipeline.scheduler.spec_decode.counts
        verified[name] = (after.drafts - before.drafts, after.accepted_tokens - before.accepted_tokens)
    handles = [pipeline.submit(prompt, max_tokens, sampling, stops.get(name, frozenset()))
               for name, sampling in options.items()]
    handles += [pipeline.submit(p, max_tokens) for p in (REPEATING, OTHERS[0])]
    return alone, read_with_logprobs(handles), verified


def _assert_same(got: Output, expected: Output, what: str) -> None:
    """Identical tokens; the same logprobs within float rounding (a 1+k-row forward may round differently in the
    last bits than a 1-row step)."""
    assert got[0] == expected[0], f"{what}: speculation changed the tokens"
    assert len(got[1]) == len(expected[1]) == (len(got[0]) if expected[1] else 0), f"{what}: logprobs per token"
    for i, (g, e) in enumerate(zip(got[1], expected[1], strict=True)):
        assert g.logprob == pytest.approx(e.logprob, abs=2e-4), f"{what}: token {i}'s logprob"
        assert [t for t, _ in g.top] == [t for t, _ in e.top], f"{what}: token {i}'s top logprobs"
        assert [v for _, v in g.top] == pytest.approx([v for _, v in e.top], abs=2e-4), f"{what}: token {i}"


def _check_options_identity(path: str, depths, max_tokens: int, each_accepted: bool = True) -> None:
    """Every option's request against one plain PP=1 pipeline. ``each_accepted``: the workload is known to loop on
    this model, so each option's request had proposals accepted (later rows of its verifications were kept, as
    processed after the proposals before them); else only the whole workload's."""
    options = _options()
    with InProcessPipeline(_stages(path, 1)) as plain:
        expected_alone, expected_batched, _ = _options_workload(plain, options, REPEATING, max_tokens)
    if each_accepted:
        # The options work: each changes what plain greedy decoding gives; the constrained output follows the regex.
        from stage_worker.checkpoint.tokenizer import load_tokenizer

        greedy = expected_batched[len(options)][0]
        assert all(expected_alone[name][0] != greedy for name in ("penalties", "logit_bias", "min_p")), greedy
        assert EOS not in expected_alone["min_tokens"][0][:10]
        constrained = [t for t in expected_alone["grammar"][0] if t != EOS]
        words = load_tokenizer(read_model_spec(path)).decode(constrained).removesuffix(".").split(" ")
        assert set(words) <= {"red", "green", "blue", "yellow"}, words
    for depth in depths:
        with InProcessPipeline(_stages(path, depth), speculative=SPECULATIVE) as speculating:
            alone, batched, verified = _options_workload(speculating, options, REPEATING, max_tokens)
            counts = speculating.scheduler.spec_decode.counts
        for name in options:
            _assert_same(alone[name], expected_alone[name], f"PP={depth} {name} alone")
            if each_accepted:
                assert verified[name][0] > 0 and verified[name][1] > 0, f"PP={depth} {name}: {verified[name]}"
        for name, got, expected in zip([*options, "greedy", "other"], batched, expected_batched, strict=True):
            _assert_same(got, expected, f"PP={depth} {name} batched")
        assert 0 < counts.accepted_tokens < counts.draft_tokens, f"PP={depth}: {counts}"


def test_every_request_option_speculates_and_keeps_its_tokens_and_logprobs(tiny_llama):
    _check_options_identity(tiny_llama, (1, 2, 3), max_tokens=20)


def test_every_request_option_speculates_on_the_layer_stack_path(checkpoints):
    _check_options_identity(tiny_checkpoint("deepseek_v3", checkpoints), (2,), max_tokens=20, each_accepted=False)


@pytest.mark.e2e
def test_speculation_keeps_greedy_tokens_on_the_default_model():
    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    path = str(default_model_path())
    # Text the model goes on repeating once it has seen it a few times, and not from its first token.
    text = "red green blue yellow, red green blue yellow, red green blue yellow, red green"
    repeating = tuple(load_tokenizer(read_model_spec(path)).encode(text))
    # PP=2 of the real model: tests/e2e/test_speculative_serve_e2e.py, through stagemesh serve.
    _check_identity(path, (1, 3), max_tokens=8, stop_case=False, small=True, repeating=repeating)


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
    (requests taking the argmax of the target's logits as they are only: a sampled row may draw another token
    than the draft's argmax, a penalized one prefer another), with another model
    most are rejected (the target's and the draft's KV both roll back)."""
    from stage_worker.speculation.draft_proposer import DraftWeights, load_draft_proposer

    with InProcessPipeline(_stages(path, 1), prefix_cache=PrefixCache(8, b"test")) as plain:
        expected = _workload(plain, repeating, max_tokens, small, all_options=not own_weights)
    config = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model=draft_path,
                               disable_by_batch_size=8)
    for depth in depths:
        proposer = load_draft_proposer(draft_path, DraftWeights.on_this_machine(1 << 40))  # as a stage loads it
        with InProcessPipeline(_stages(path, depth), speculative=config, prefix_cache=PrefixCache(8, b"test"),
                               proposer=proposer) as speculating:
            got = _workload(speculating, repeating, max_tokens, small, all_options=not own_weights)
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
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.tokenizer import load_tokenizer
    from stage_worker.speculation.draft_proposer import check_draft_model

    path = str(default_model_path())
    draft = convert_gguf_to_mlx_dir(path, str(tmp_path / "draft"))
    check_draft_model(draft, read_model_spec(path))
    text = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    prompt = tuple(load_tokenizer(read_model_spec(path)).encode(text))
    _check_draft_identity(path, draft, (2,), max_tokens=8, own_weights=True, small=True, repeating=prompt)
