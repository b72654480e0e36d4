"""OpenAI fields to stage sampling: validation messages name the field and the numbers."""

from __future__ import annotations

import pytest

from gateway.chat.sampling import settings_from_request
from gateway.http.errors import APIError
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest


def chat(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def refused(req) -> APIError:
    with pytest.raises(APIError) as e:
        settings_from_request(req)
    assert e.value.status == 400
    return e.value


def test_defaults():
    s = settings_from_request(CompletionRequest(prompt="x"))
    assert (s.n, s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.sampling.seed, s.stop, s.stream) == \
        (1, 1.0, 1.0, 0, None, (), False)
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
    ({"logprobs": 21}, "logprobs", "between 0 and 20, got 21"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2], got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2], got 0"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"logit_bias": {"50": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "out of the vocabulary"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "between 0 and max_tokens (3), got 5"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
    ({"echo": True, "logprobs": 1}, "echo", "not supported"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"seed": 2**64}, "seed", "64-bit"),
])
def test_completion_field_errors(kw, param, words):
    err = refused(CompletionRequest(prompt="x", **kw))
    assert err.param == param and words in err.message, err.message


def test_chat_names_the_core_fields_by_its_own_names():
    assert "top_logprobs must be between 0 and 20, got 21." in refused(chat(logprobs=True, top_logprobs=21)).message
    err = refused(chat(min_tokens=5, max_completion_tokens=3))
    assert err.param == "min_tokens" and "between 0 and max_completion_tokens (3), got 5" in err.message


@pytest.mark.parametrize("kw, param", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_field_errors(kw, param):
    assert refused(chat(**kw)).param == param


def test_defaults_of_unsupported_fields_are_fine():
    s = settings_from_request(chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                   response_format={"type": "text"}, tool_choice="none", user="u",
                                   top_k=-1, stream=True, stream_options={"include_usage": True}))
    assert s.sampling.top_k == 0 and s.include_usage


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


def test_vllm_knobs_reach_the_stage_sampling():
    s = settings_from_request(chat(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                                   logit_bias={"7": -100, "3": 2.5}, min_p=0.1, min_tokens=2, max_tokens=9,
                                   stop_token_ids=[11, 11, 12], allowed_token_ids=[1, 2, 3], logprobs=True,
                                   top_logprobs=4, ignore_eos=True), vocab_size=100)
    p = s.stage_sampling(0)
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.min_tokens) == (0.5, -0.25, pytest.approx(0.1), 2)
    assert p.repetition_penalty == pytest.approx(1.2) and dict(p.logit_bias) == {7: -100.0, 3: 2.5}
    assert list(p.allowed_token_ids) == [1, 2, 3] and p.logprobs == 4
    assert s.stop_token_ids(frozenset({2})) == {11, 12}  # ignore_eos drops EOS, keeps the request's own
    assert settings_from_request(chat(stop_token_ids=[11])).stop_token_ids(frozenset({2})) == {2, 11}
    assert not settings_from_request(chat()).stage_sampling(0).HasField("logprobs")
    assert settings_from_request(chat(logprobs=True)).stage_sampling(0).logprobs == 0


def test_generation_config_fills_only_unset_fields(tmp_path):
    from gateway.chat.defaults import generation_defaults_from_file, model_generation_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 64}')
    d = model_generation_defaults(str(tmp_path))
    s = settings_from_request(chat(), d)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.top_k, s.sampling.repetition_penalty,
            s.max_tokens) == (0.6, 0.95, 20, 1.1, 64)
    s = settings_from_request(chat(temperature=0, top_k=-1, max_tokens=5), d)
    assert (s.sampling.temperature, s.sampling.top_k, s.max_tokens) == (0.0, 0, 5)
    (tmp_path / "g.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert generation_defaults_from_file(str(tmp_path / "g.json")).temperature == 0.0
    assert model_generation_defaults(str(tmp_path / "absent")).temperature is None


def test_structured_output_becomes_one_grammar_for_the_stage():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s = settings_from_request(chat(response_format={"type": "json_schema",
                                                    "json_schema": {"name": "a", "schema": schema, "strict": True}}))
    assert s.sampling.grammar and s.stage_sampling(0).grammar == s.sampling.grammar
    assert settings_from_request(chat(response_format={"type": "json_object"})).sampling.grammar
    assert settings_from_request(chat(guided_choice=["yes", "no"])).sampling.grammar
    assert settings_from_request(chat(structured_outputs={"choice": ["yes", "no"]})).sampling.grammar == \
        settings_from_request(chat(guided_choice=["yes", "no"])).sampling.grammar
    with pytest.raises(APIError) as e:
        settings_from_request(chat(structured_outputs={"yaml": "x"}))
    assert e.value.param == "structured_outputs"
    assert not settings_from_request(chat(response_format={"type": "text"})).sampling.grammar
    assert not settings_from_request(chat()).stage_sampling(0).grammar
