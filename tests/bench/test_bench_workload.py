"""Workload of stagemesh bench: seeded prompts of the asked length, and request bodies."""

from __future__ import annotations

import pytest

from stagemesh.bench.types import Workload
from stagemesh.bench.workload import (
    COUNT_INSTRUCTION,
    WORDS,
    approx_tokens,
    load_tokenizer,
    make_prompt,
    min_input_tokens,
    request_body,
)


def test_prompts_are_seeded_and_distinct_per_key():
    assert make_prompt("0:1:concurrency=4:7", 200) == make_prompt("0:1:concurrency=4:7", 200)
    a, b = make_prompt("0:1:concurrency=4:7", 200).text, make_prompt("0:1:concurrency=4:8", 200).text
    # different from the first words on, so no prefix cache shares them
    assert a.split()[:3] != b.split()[:3]


def test_prompt_without_tokenizer_approximates_tokens_by_words():
    p = make_prompt("k", 300)
    assert p.tokens_source == "words" and p.tokens == 300 == approx_tokens(p.text)
    assert p.text.endswith(COUNT_INSTRUCTION)
    filler = p.text[: -len(COUNT_INSTRUCTION)].split()
    assert set(filler) <= set(WORDS)


def test_a_target_shorter_than_the_instruction_yields_the_instruction():
    p = make_prompt("k", 1)
    assert p.text == COUNT_INSTRUCTION.lstrip() and p.tokens > 1


def test_32_token_prompts_fit_and_differ(tokenizer):
    # the serving comparisons use 32-token prompts: they must be distinct, not just the instruction
    assert min_input_tokens(tokenizer) <= 32
    a, b = make_prompt("0:1:concurrency=16:0", 32, tokenizer), make_prompt("0:1:concurrency=16:1", 32, tokenizer)
    assert a.tokens == b.tokens == 32 and a.text != b.text
    assert tokenizer.encode(a.text)[:3] != tokenizer.encode(b.text)[:3]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(default_model_path)  # the GGUF path of --tokenizer


@pytest.mark.parametrize("n", [64, 100, 257, 1024])
def test_prompt_with_a_tokenizer_has_exactly_the_asked_tokens(tokenizer, n):
    p = make_prompt(f"0:{n}", n, tokenizer)
    assert p.tokens_source == "tokenizer"
    assert p.tokens == len(tokenizer.encode(p.text)) == n
    assert p.text.endswith(COUNT_INSTRUCTION)


def workload(**kw) -> Workload:
    base = dict(endpoint_type="completions", input_tokens=8, output_tokens=16, seed=0, ignore_eos=False,
                include_usage=True, temperature=0.0)
    return Workload(**{**base, **kw})


def test_completions_body_streams_with_usage_and_no_ignore_eos_unless_asked():
    p = make_prompt("k", 8)
    body = request_body(workload(), "m", p)
    assert body == {"model": "m", "prompt": p.text, "max_tokens": 16, "stream": True, "temperature": 0.0,
                    "stream_options": {"include_usage": True}}
    assert request_body(workload(ignore_eos=True), "m", p)["ignore_eos"] is True
    assert "stream_options" not in request_body(workload(include_usage=False), "m", p)


def test_chat_body_sends_the_prompt_as_one_user_message():
    p = make_prompt("k", 8)
    body = request_body(workload(endpoint_type="chat"), "m", p)
    assert body["messages"] == [{"role": "user", "content": p.text}] and "prompt" not in body
