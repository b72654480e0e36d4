"""The sampling knobs, logprobs, structured output and tools on the real model, through the OpenAI SDK.

The sampling knobs and logprobs are checked on PP=1 and PP=2 at once, and the two layouts must give the same
answer; logprobs must equal a log-softmax of the logits mlx-lm's own model computes on the same weights.
Structured output and tools sit above the model (the gateway's grammar and the last stage's mask), so each is
checked on one layout: most at PP=2, where the stage that samples is not the stage that embeds; guided choice
and regex, and a named tool call's streamed deltas, at PP=1.
"""

from __future__ import annotations

import importlib
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "List the days of the week."}]
REPEATS = "one two one two one two one two"


@pytest.fixture(scope="module")
def servers(serve_pp1, serve_pp2):
    """PP=1 and PP=2: the package's shared serves (tests/e2e/conftest.py)."""
    started = [serve_pp1, serve_pp2]
    return [openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0) for s in started], started


@pytest.fixture(scope="module")
def clients(servers):
    return servers[0]


@pytest.fixture(scope="module")
def pp1(clients):
    """The PP=1 client alone: for what sits above the model."""
    return clients[0]


@pytest.fixture(scope="module")
def pp2(clients):
    """The PP=2 client alone: for what sits above the model."""
    return clients[1]


def both(clients, call):
    """Run ``call(client)`` on PP=1 and PP=2, at once (two servers: the layouts compute side by side); they must
    give the same tokens, text and counts, and the same logprobs up to float noise.

    Why not every float exactly: a request can arrive while the previous one's last step is still in the engine,
    and a batch of other rows runs its matmuls in other blocks, which rounds differently in the last bits
    (`stagemesh bench parity` checks PP bit-exact where the batches are the same)."""
    with ThreadPoolExecutor(len(clients)) as pool:
        first, second = pool.map(call, clients)
    assert _same_up_to_float_noise(first, second), (first, second)
    return first


def _same_up_to_float_noise(a, b) -> bool:
    """Equal structures, every float within 1e-4 of its counterpart and everything else exactly equal."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, abs=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_up_to_float_noise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_up_to_float_noise, a, b))
    return a == b


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.tokenizer import load_tokenizer

    return load_tokenizer(read_model_spec(default_model_path))


@pytest.fixture(scope="module")
def mlx_lm_model(default_model_path):
    """mlx-lm's own model class with every weight of the default model."""
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.checkpoint.stage_weights import load_stage_weights

    spec = read_model_spec(default_model_path)
    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))
    weights = load_stage_weights(spec, range(spec.num_layers), with_embedding=True, with_head=True)

    def quantized(path: str, _module: nn.Module):
        if f"{path}.scales" not in weights:
            return False
        return spec.quantization_for(path).as_kwargs()

    nn.quantize(model, class_predicate=quantized)
    model.load_weights(list(weights.items()), strict=True)
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    return model


def _completion(client, **kw):
    r = client.completions.create(model=MODEL, temperature=0, **kw)
    c = r.choices[0]
    return c.text, c.finish_reason, (c.logprobs.model_dump() if c.logprobs else None), r.usage.completion_tokens


def test_completion_logprobs_equal_mlx_lm_log_softmax(clients, mlx_lm_model, tokenizer):
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=True)
    _, _, lp, _ = both(clients, lambda c: _completion(c, prompt=prompt, max_tokens=6, logprobs=5))
    ids = list(prompt)
    for i, (token, value, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        logits = mlx_lm_model(mx.array([ids]))[0, -1].astype(mx.float32)
        reference = np.array(logits - mx.logsumexp(logits))
        best = int(np.argmax(reference))
        assert token == tokenizer.decode([best])  # greedy: the most likely token
        assert value == pytest.approx(float(reference[best]), abs=2e-3)
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True) and next(iter(top)) == token
        np.testing.assert_allclose(values, np.sort(reference)[::-1][:5], atol=2e-3)
        assert lp["text_offset"][i] == sum(len(t) for t in lp["tokens"][:i])
        ids.append(best)


def test_chat_logprobs_shape_streamed_and_not(clients):
    def run(client):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12,
                                           logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12,
                                                logprobs=True, top_logprobs=3, stream=True)
        streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                    for e in chunk.choices[0].logprobs.content]
        # The same tokens, with the same logprobs up to float noise: the streamed request repeats the first's
        # prompt, so it starts from the first one's cached prefix (prefix caching, on by default), whose KV was
        # computed in other chunk shapes than a fresh prefill.
        assert [_shape(e.model_dump()) for e in streamed] == [_shape(e.model_dump()) for e in content]
        assert [v for e in streamed for v in _values(e.model_dump())] == pytest.approx(
            [v for e in content for v in _values(e.model_dump())], abs=1e-3)
        return r.choices[0].message.content, [e.model_dump() for e in content]

    text, content = both(clients, run)
    assert "".join(e["token"] for e in content) == text
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == text
    for e in content:
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e["top_logprobs"][0]["token"] == e["token"] and e["logprob"] == tops[0] <= 0


def _shape(entry: dict) -> tuple:
    """A chat logprobs entry without its values: the token, its bytes and the order of its alternatives."""
    return entry["token"], entry["bytes"], [(t["token"], t["bytes"]) for t in entry["top_logprobs"]]


def _values(entry: dict) -> list[float]:
    return [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]


def _distinct_share(lp: dict) -> float:
    return len(set(lp["tokens"])) / len(lp["tokens"])


@pytest.fixture(scope="module")
def plain_repeats(clients):
    """The unpenalized completion the penalty tests compare against: one request, shared by them."""
    return both(clients, lambda c: _completion(c, prompt=REPEATS, max_tokens=16, logprobs=0,
                                              extra_body={"ignore_eos": True}))


@pytest.mark.parametrize("field, value", [("frequency_penalty", 1.5), ("presence_penalty", 1.5),
                                          ("repetition_penalty", 1.8)])
def test_positive_penalties_make_output_less_repetitive(clients, plain_repeats, field, value):
    plain = plain_repeats
    penalized = both(clients, lambda c: _completion(c, prompt=REPEATS, max_tokens=16, logprobs=0,
                                                   extra_body={"ignore_eos": True, field: value}))
    assert _distinct_share(penalized[2]) > _distinct_share(plain[2]), (plain[0], penalized[0])


def test_negative_presence_penalty_makes_output_more_repetitive(clients):
    prompt = "Write a short story about a cat."
    plain = both(clients, lambda c: _completion(c, prompt=prompt, max_tokens=16, logprobs=0,
                                               extra_body={"ignore_eos": True}))
    rewarded = both(clients, lambda c: _completion(c, prompt=prompt, max_tokens=16, logprobs=0,
                                                  presence_penalty=-2.0, extra_body={"ignore_eos": True}))
    assert _distinct_share(rewarded[2]) < _distinct_share(plain[2]), (plain[0], rewarded[0])


def test_logit_bias_and_allowed_token_ids_steer_the_tokens(clients, tokenizer):
    x = tokenizer.encode(" banana", add_special_tokens=False)[0]
    text, _, _, _ = both(clients, lambda c: _completion(c, prompt="Hello", max_tokens=4,
                                                       logit_bias={str(x): 100}))
    assert text == tokenizer.decode([x] * 4)
    first, _, _, _ = both(clients, lambda c: _completion(c, prompt="The capital of France is", max_tokens=1))
    banned = tokenizer.encode(first, add_special_tokens=False)[0]
    other, _, _, _ = both(clients, lambda c: _completion(c, prompt="The capital of France is", max_tokens=1,
                                                        logit_bias={str(banned): -100}))
    assert other != first
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    text, _, _, _ = both(clients, lambda c: _completion(c, prompt="Hi", max_tokens=5,
                                                       extra_body={"allowed_token_ids": allowed}))
    assert set(tokenizer.encode(text, add_special_tokens=False)) <= set(allowed)


def test_min_tokens_stop_token_ids_and_ignore_eos(clients, tokenizer):
    def chat(client, max_tokens=64, **extra):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           temperature=0, max_tokens=max_tokens, extra_body=extra)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    text, finish, natural = both(clients, chat)
    assert finish == "stop" and natural < 50  # the model ends its turn early
    # A max_tokens above min_tokens, so the answer it forces past its end stops soon after.
    _, finish, tokens = both(clients, lambda c: chat(c, min_tokens=natural + 10, max_tokens=natural + 14))
    assert natural + 10 <= tokens <= natural + 14
    _, finish, tokens = both(clients, lambda c: chat(c, max_tokens=natural + 4, ignore_eos=True))
    assert (finish, tokens) == ("length", natural + 4)
    stop_at = tokenizer.encode(text, add_special_tokens=False)[1]
    cut, finish, _ = both(clients, lambda c: chat(c, stop_token_ids=[stop_at]))
    assert finish == "stop" and text.startswith(cut) and len(cut) < len(text)


def test_seeded_sampling_with_top_k_and_min_p_repeats_across_layouts(clients):
    def run(client, seed):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                      seed=seed, extra_body={"top_k": 40, "min_p": 0.05, "ignore_eos": True})
        return r.choices[0].text

    assert both(clients, lambda c: run(c, 7)) == both(clients, lambda c: run(c, 7))
    assert len({both(clients, lambda c, s=s: run(c, s)) for s in range(4)}) > 1


def test_echo_puts_the_prompt_first(clients):
    text, _, _, _ = both(clients, lambda c: _completion(c, prompt="The capital of France is", max_tokens=3,
                                                       echo=True))
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is")


def test_unknown_fields_are_still_a_clear_400(servers):
    _, started = servers
    r = httpx.post(f"{started[0].url}/v1/chat/completions", json={"messages": CHAT, "mirostat_tau": 5})
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "mirostat_tau"


# -- structured output -------------------------------------------------------------------------------------------

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
               "properties": {"name": {"type": "string", "maxLength": 30},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string", "maxLength": 30},
                                                         "zip": {"type": "integer", "minimum": 0,
                                                                 "maximum": 99999}}}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "sure"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "sure": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["days"],
              "properties": {"days": {"type": "array", "minItems": 2, "maxItems": 4,
                                      "items": {"type": "string", "maxLength": 12}}}},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_always_validates(pp2, name):
    import jsonschema

    schema = SCHEMAS[name]

    def run(client):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=0,
            max_tokens=200, response_format={"type": "json_schema",
                                             "json_schema": {"name": name, "schema": schema, "strict": True}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    text, finish = run(pp2)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_sampled_rows(pp2):
    def run(client, **kw):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, **kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    [(text, finish)] = run(pp2, temperature=0, response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    schema = SCHEMAS["enum"]
    fmt = {"type": "json_schema", "json_schema": {"name": "enum", "schema": schema}}
    sampled = run(pp2, temperature=1.0, seed=5, n=4, response_format=fmt)
    for text, finish in sampled:
        assert finish == "stop"
        assert json.loads(text)["color"] in ("red", "green", "blue")


def test_sdk_parse_with_a_pydantic_model(pp2):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        size: Literal["small", "medium", "large"]

    def run(client):
        r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=100, response_format=City,
                                          messages=[{"role": "user", "content": "Tell me about Paris."}])
        return r.choices[0].message.parsed

    city = run(pp2)
    assert isinstance(city, City)


def test_guided_choice_and_regex(pp1):
    def run(client, extra):
        r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", temperature=0, max_tokens=10,
                                      extra_body=extra)
        return r.choices[0].text

    assert run(pp1, {"guided_choice": ["yes", "no"]}) in ("yes", "no")
    import re

    assert re.fullmatch(r"[0-9]{3}", run(pp1, {"guided_regex": "[0-9]{3}"}))


# -- tool calling ------------------------------------------------------------------------------------------------

# Open schemas, as agent frameworks send them (no additionalProperties): the server's strict default closes them,
# and every call is checked against the closed schema.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 40}}}}}


def _closed(tool: dict) -> dict:
    return {**tool["function"]["parameters"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_has_arguments_valid_for_its_schema(pp2, choice):
    import jsonschema

    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"

    def run(client):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                           max_tokens=80, tool_choice=tool_choice)
        return r.choices[0].finish_reason, _calls(r.choices[0].message)

    finish, calls = run(pp2)
    assert finish == "tool_calls" and calls
    schemas = {t["function"]["name"]: _closed(t) for t in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    if choice == "named":
        assert [name for name, _ in calls] == ["get_weather"]


def test_named_tool_call_streams_argument_deltas(pp1):
    def run(client):
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        chunks = list(stream)
        deltas = [d for chunk in chunks for d in (chunk.choices[0].delta.tool_calls or [])]
        return deltas, chunks[-1].choices[0].finish_reason

    deltas, finish = run(pp1)
    assert finish == "tool_calls"
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2  # the arguments arrive in pieces
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments)["unit"] in ("celsius", "fahrenheit")
    whole = pp1.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert whole.choices[0].message.tool_calls[0].function.arguments == arguments


def test_required_tool_calls_stream_argument_deltas_equal_to_the_unstreamed_call(pp2):
    import jsonschema

    schemas = {t["function"]["name"]: _closed(t) for t in (WEATHER, TIME)}
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
               tool_choice="required", logprobs=True)

    def run(client):
        whole = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True))
        deltas = [d for chunk in chunks if chunk.choices for d in (chunk.choices[0].delta.tool_calls or [])]
        finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
        streamed: dict[int, list[str]] = {}
        for d in deltas:
            if d.id is not None:  # a call's first delta: id, type, name and empty arguments
                assert d.index == len(streamed) and d.type == "function" and d.function.arguments == ""
                streamed[d.index] = [d.function.name, ""]
            else:
                assert d.function.name is None
                streamed[d.index][1] += d.function.arguments
        pieces = sum(1 for d in deltas if d.id is None)
        message = whole.choices[0].message
        unstreamed = [[c.function.name, c.function.arguments] for c in message.tool_calls]
        # Every token's logprobs arrive, those of the JSON around the arguments too.
        tokens = [e.token for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                  for e in chunk.choices[0].logprobs.content]
        assert tokens == [e.token for e in whole.choices[0].logprobs.content]
        return (whole.choices[0].finish_reason, unstreamed, finishes[-1], [streamed[i] for i in sorted(streamed)],
                pieces, "".join(tokens))

    finish, unstreamed, streamed_finish, streamed, pieces, text = run(pp2)
    assert json.loads(text) == [{"name": name, "parameters": json.loads(args)} for name, args in streamed]
    assert finish == streamed_finish == "tool_calls"
    assert streamed == unstreamed and pieces > 2  # the arguments arrive in pieces that add up to the call's
    for name, arguments in streamed:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_tool_round_trip_call_result_answer(pp2):
    def run(client):
        first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                               max_tokens=80, tool_choice="required")
        message = first.choices[0].message
        call = message.tool_calls[0]
        history = [*ASK, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
        answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                                max_tokens=60, tool_choice="auto")
        return answer.choices[0].finish_reason, answer.choices[0].message.content, _calls(answer.choices[0].message)

    finish, content, calls = run(pp2)
    assert (finish, calls) == ("stop", []) and content, (finish, content, calls)


def test_tool_choice_without_tools_is_a_400(pp2):
    with pytest.raises(openai.BadRequestError) as e:
        pp2.chat.completions.create(model=MODEL, messages=ASK, tool_choice="auto")
    assert e.value.body["param"] == "tool_choice"


# -- cached tokens -------------------------------------------------------------------------------------------------

def test_a_conversations_later_turn_reports_its_history_as_cached(pp2):
    """The real entry stage's figure through the gateway: a turn that resends the previous turn and its reply
    restores them from the prefix cache (whole 16-token blocks), and the usage says how many positions."""
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    first = [system, {"role": "user", "content": "Name a colour."}]
    r1 = pp2.chat.completions.create(model=MODEL, messages=first, temperature=0, max_tokens=16)
    turn2 = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And another one?"}]
    r2 = pp2.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=16)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and r2.usage.prompt_tokens / 2 <= cached < r2.usage.prompt_tokens, r2.usage
    assert cached >= r1.usage.prompt_tokens // 16 * 16  # at least the first turn's whole blocks
