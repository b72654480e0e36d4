"""OpenAI fields to stage sampling: validation messages name the field and the numbers."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.sampling_params import settings_from_request
from gateway.schemas import ChatCompletionRequest, CompletionRequest


def chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def refused(req) -> APIError:
    with pytest.raises(APIError) as e:
        settings_from_request(req)
    assert e.value.status == 400
    return e.value


def test_defaults():
    s = settings_from_request(CompletionRequest(prompt="x"))
    assert (s.n, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.stream) == (1, 1.0, 1.0, 0, None, (), False)
    assert s.max_tokens_for(10, 2048, "prompt") == 2038  # the room left
    assert not s.stage_sampling(0).HasField("seed")


@pytest.mark.parametrize("kw, param, words", [
    ({"temperature": 2.5}, "temperature", "[0, 2], got 2.5"),
    ({"temperature": -0.1}, "temperature", "[0, 2]"),
    ({"temperature": float("nan")}, "temperature", "[0, 2]"),
    ({"top_p": 0.0}, "top_p", "(0, 1], got 0.0"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"n": 0}, "n", "between 1 and 16, got 0"),
    ({"n": 17}, "n", "got 17"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"stop": ["a", ""]}, "stop", "empty string"),
    ({"stop": ""}, "stop", "empty string"),
    ({"max_tokens": 0}, "max_tokens", "at least 1, got 0"),
    ({"logprobs": 1}, "logprobs", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"frequency_penalty": -1}, "frequency_penalty", "not supported"),
    ({"logit_bias": {"50": 1.0}}, "logit_bias", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"seed": 2**64}, "seed", "64-bit"),
])
def test_completion_field_errors(kw, param, words):
    err = refused(CompletionRequest(prompt="x", **kw))
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("kw, param", [
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_field_errors(kw, param):
    assert refused(chat(**kw)).param == param


def test_defaults_of_unsupported_fields_are_fine():
    s = settings_from_request(chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                   response_format={"type": "text"}, tool_choice="none", user="u",
                                   top_k=-1, stream=True, stream_options={"include_usage": True}))
    assert s.top_k == 0 and s.include_usage


def test_max_completion_tokens_wins_and_context_is_checked():
    s = settings_from_request(chat(max_tokens=5, max_completion_tokens=7))
    assert s.max_tokens_for(100, 2048, "messages") == 7
    s = settings_from_request(chat(max_tokens=2000))
    with pytest.raises(APIError) as e:
        s.max_tokens_for(100, 2048, "messages")
    assert e.value.param == "max_tokens"
    assert "2048" in e.value.message and "2100" in e.value.message and "100 in the prompt" in e.value.message
    with pytest.raises(APIError) as e:
        settings_from_request(chat()).max_tokens_for(2048, 2048, "messages")
    assert e.value.param == "messages" and "2048 input tokens" in e.value.message


def test_seeds_per_choice_stay_in_the_stage_range():
    s = settings_from_request(CompletionRequest(prompt="x", seed=41, n=3, temperature=0.7, top_p=0.9, top_k=5))
    params = [s.stage_sampling(i) for i in range(3)]
    assert [p.seed for p in params] == [41, 42, 43]
    assert params[0].top_k == 5 and abs(params[0].temperature - 0.7) < 1e-6
    neg = settings_from_request(CompletionRequest(prompt="x", seed=-1)).stage_sampling(0)
    assert neg.seed >= 0  # -1 means "no seed" on the wire: fold negatives into range
