"""The sampling contract of the core: one shape, its ranges and defaults, one check naming the field,
one conversion to and from the proto and JSON."""

from __future__ import annotations

import math

import pytest

from stagemesh_core import sampling
from stagemesh_core.sampling import DEFAULTS, GREEDY, SamplingError, SamplingParams, check, from_proto, to_proto
from stagemesh_core.v1 import stage_pb2

EVERY_FIELD = SamplingParams(temperature=0.5, top_p=0.75, top_k=40, seed=7, presence_penalty=0.5,
                             frequency_penalty=-0.25, repetition_penalty=1.25, logit_bias=((3, -100.0), (9, 2.5)),
                             allowed_token_ids=(3, 9, 11), min_p=0.125, min_tokens=2, logprobs=5,
                             grammar="start: \"a\"")


def test_the_defaults_are_openais_and_greedy_only_changes_the_temperature():
    assert (DEFAULTS.temperature, DEFAULTS.top_p, DEFAULTS.top_k, DEFAULTS.seed) == (1.0, 1.0, 0, None)
    assert (DEFAULTS.presence_penalty, DEFAULTS.frequency_penalty, DEFAULTS.repetition_penalty) == (0.0, 0.0, 1.0)
    assert DEFAULTS.logprobs is None and DEFAULTS.grammar == "" and not DEFAULTS.greedy
    assert GREEDY.greedy and GREEDY == SamplingParams(temperature=0.0)
    check(DEFAULTS)
    check(EVERY_FIELD, vocab_size=12, max_tokens=2)


@pytest.mark.parametrize("change, field, words", [
    ({"temperature": 2.5}, "temperature", "must be in [0, 2], got 2.5."),
    ({"temperature": math.nan}, "temperature", "[0, 2]"),
    ({"top_p": 0.0}, "top_p", "must be in (0, 1], got 0.0."),
    ({"top_k": -1}, "top_k", "0 (disabled) or between 1 and"),
    ({"seed": -1}, "seed", "between 0 and"),
    ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": 3.0}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "(0, 2]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20, got 21."),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias", "[-100, 100], got 101.0."),
    ({"logit_bias": tuple((t, 1.0) for t in range(sampling.MAX_LOGIT_BIAS + 1))}, "logit_bias", "at most 1024"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias", "token id -1 is out of the vocabulary"),
    ({"allowed_token_ids": (3, 12)}, "allowed_token_ids", "token id 12 is out of the vocabulary (0..11)"),
])
def test_check_names_the_field_and_the_range(change, field, words):
    with pytest.raises(SamplingError) as refused:
        check(SamplingParams(**change), vocab_size=12)
    assert refused.value.name == field and words in str(refused.value) and str(refused.value).startswith(field)


def test_the_caller_names_the_fields_its_own_way():
    names = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}
    with pytest.raises(SamplingError) as refused:
        check(SamplingParams(min_tokens=5), max_tokens=3, name=lambda f: names.get(f, f))
    assert refused.value.name == "min_tokens"
    assert "min_tokens must be between 0 and max_completion_tokens (3), got 5." == str(refused.value)
    with pytest.raises(SamplingError) as refused:
        check(SamplingParams(logprobs=30), name=lambda f: names.get(f, f))
    assert refused.value.name == "top_logprobs" and str(refused.value).startswith("top_logprobs must be")


def test_the_proto_carries_every_field_and_its_zero_values_mean_the_defaults():
    back = from_proto(to_proto(EVERY_FIELD))
    assert back == EVERY_FIELD  # every value above is exact in float32
    assert from_proto(to_proto(DEFAULTS)) == DEFAULTS
    empty = from_proto(stage_pb2.SamplingParams())
    assert empty == GREEDY  # proto3's zero temperature is greedy; unset top_p and repetition_penalty the defaults
    assert not to_proto(DEFAULTS).HasField("seed") and not to_proto(DEFAULTS).HasField("logprobs")
    assert to_proto(SamplingParams(logprobs=0)).HasField("logprobs")


def test_json_round_trip_and_missing_keys_take_the_defaults():
    assert SamplingParams.from_json(EVERY_FIELD.to_json()) == EVERY_FIELD
    assert SamplingParams.from_json({}) == DEFAULTS
    assert SamplingParams.from_json({"temperature": 0}) == GREEDY
