"""Ollama's API through the real ``ollama`` Python client (and raw HTTP), against the gateway over a fake stage: the
model described, chat and generate whole and as NDJSON, tools, structured output, every option's mapping onto
what the stage is asked, Open WebUI's request sequence, and every refusal in Ollama's ``{"error": ...}`` shape
before anything reaches a stage."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from gateway.app import GatewayConfig, create_app
from gateway.chat.defaults import OpenAIDefaults
from stagemesh_core.model_card import ModelCard

from .conftest import API_KEY, MODEL
from .fakes import AppServer

LISTED = f"{MODEL}:latest"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
CARD = ModelCard(family="llama", format="gguf", parameter_count=134_515_008, size_bytes=98_362_432,
                 quantization_level="Q4_1", modified_at=1_796_584_148.0, digest="ab" * 32, num_layers=30,
                 hidden_size=576, num_heads=9, num_kv_heads=3, vocab_size=49152, context_length=8192)
TIMINGS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
           "eval_duration")


@pytest.fixture(scope="module")
def carded(mesh, tokenizer, eos_ids):
    """A gateway that knows its model's card, as `stagemesh serve` starts it."""
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048, request_timeout_s=30, model_card=CARD)
    s = AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
    yield s
    s.stop()


@pytest.fixture
def llama(carded, stage, healthy_mesh) -> ollama.Client:
    return ollama.Client(host=carded.url, timeout=20)


def _sent(stage):
    return stage.requests[-1]


def _chat_prompt(server, stage, body: dict) -> list[int]:
    """The prompt the chat endpoint sends the stage for ``body``: the reference for every translation."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=20)
    assert r.status_code == 200, r.text
    return list(_sent(stage).prompt_token_ids)


def _lines(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert response.text.endswith("\n")
    return [json.loads(line) for line in response.text.splitlines()]


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


def _post(server, path: str, body: dict, status: int = 400) -> str:
    return _error(httpx.post(f"{server.url}{path}", json=body, timeout=20), status)


# ------------------------------------------------------------------ the model


def test_version_tags_show_and_ps_describe_the_served_model(llama, carded):
    assert httpx.get(f"{carded.url}/api/version").json()["version"] == "0.12.0"
    assert "stagemesh_version" in httpx.get(f"{carded.url}/api/version").json()
    (listed,) = llama.list().models
    assert (listed.model, listed.size, listed.digest) == (LISTED, CARD.size_bytes, CARD.digest)
    assert listed.details.model_dump(exclude_none=True) == {
        "parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"], "parameter_size": "134.52M",
        "quantization_level": "Q4_1"}
    assert listed.modified_at is not None and listed.modified_at.year == 2026
    raw = httpx.get(f"{carded.url}/api/tags").json()["models"][0]
    assert raw["name"] == raw["model"] == LISTED
    shown = llama.show(LISTED)
    assert shown.modelinfo["llama.context_length"] == 2048  # the served context
    assert shown.modelinfo["general.parameter_count"] == CARD.parameter_count
    assert shown.modelinfo["llama.block_count"] == 30 and shown.modelinfo["general.architecture"] == "llama"
    assert shown.capabilities == ["completion", "tools"]  # SmolLM2's template writes no reasoning
    assert "num_ctx 2048" in shown.parameters and shown.template and shown.details.quantization_level == "Q4_1"
    assert llama.show(MODEL).details.family == "llama"  # the name without its tag is the same model
    (running,) = llama.ps().models
    assert (running.model, running.size, running.context_length) == (LISTED, CARD.size_bytes, 2048)
    assert running.size_vram == 0  # the fake stage computes on the CPU
    assert running.expires_at is not None and running.expires_at.year > 2300  # never unloaded


def test_the_default_models_card_is_what_ollama_lists_for_it():
    """`stagemesh serve` builds the card from the spec (no tensor data read): SmolLM2-135M's Q4_1 GGUF, listed
    by Ollama itself as 134.52M parameters."""
    import os

    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stagemesh.model_card import model_card
    from stagemesh_core.model_card import parameter_size

    path = resolve_model_path(None)
    card = model_card(read_model_spec(path))
    assert (card.family, card.format, card.quantization_level) == ("llama", "gguf", "Q4_1")
    assert (card.parameter_count, parameter_size(card.parameter_count)) == (134_515_008, "134.52M")
    assert card.size_bytes == os.path.getsize(path) and card.modified_at == os.path.getmtime(path)
    assert (card.num_layers, card.hidden_size, card.num_heads, card.num_kv_heads) == (30, 576, 9, 3)
    assert card.context_length == 8192 and len(card.digest) == 64
    assert [parameter_size(n) for n in (8_030_261_248, 7_000_000_000, 1_500_000, 999)] == ["8.0B", "7B", "1.50M",
                                                                                             "999"]


def test_ps_lists_nothing_while_no_replica_serves(llama, healthy_mesh):
    healthy_mesh.healthy[0] = False
    assert llama.ps().models == []


def test_a_gateway_without_a_card_still_answers(server, stage, healthy_mesh):
    (listed,) = ollama.Client(host=server.url).list().models
    assert listed.model == LISTED and listed.details.parameter_size == ""


def test_head_routes_and_ollamas_root_on_its_own_port(mesh, tokenizer, eos_ids, carded):
    assert httpx.head(f"{carded.url}/api/version").status_code == 200
    assert httpx.head(f"{carded.url}/api/tags").status_code == 200
    assert "Ollama is running" not in httpx.get(f"{carded.url}/").text  # the dashboard keeps / on this port
    server = AppServer(None)  # its port first: the app answers Ollama's GET / on it
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048, ollama_port=server.port)
    server.server.config.app = create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)
    server.start()
    try:
        r = httpx.get(f"{server.url}/")
        assert (r.status_code, r.text) == (200, "Ollama is running")
        assert r.headers["content-type"].startswith("text/plain")
        assert httpx.head(f"{server.url}/").status_code == 200
        assert httpx.get(f"{server.url}/api/version").json()["version"] == "0.12.0"
    finally:
        server.stop()


# ------------------------------------------------------------------ chat


def test_chat_is_the_chat_endpoints_generation_with_ollamas_timings(llama, carded, stage):
    r = llama.chat(model=LISTED, messages=[{"role": "system", "content": "Be brief."}, *ASK], stream=False)
    assert r.message.role == "assistant" and r.message.content == "Hello there!" and r.model == LISTED
    assert r.done and r.done_reason == "stop" and r.created_at.endswith("Z")
    sent = list(_sent(stage).prompt_token_ids)
    assert (r.prompt_eval_count, r.eval_count) == (len(sent), 4)  # EOS counts, as in chat's usage
    assert r.load_duration == 0 and r.prompt_eval_duration > 0 and r.eval_duration >= 0
    assert abs(r.total_duration - r.prompt_eval_duration - r.eval_duration) <= 2  # one clock, rounded to ns
    assert _chat_prompt(carded, stage, {"messages": [{"role": "system", "content": "Be brief."}, *ASK]}) == sent


def test_chat_streams_ndjson_by_default(carded, stage, healthy_mesh):
    r = httpx.post(f"{carded.url}/api/chat", json={"model": LISTED, "messages": ASK}, timeout=20)
    lines = _lines(r)
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"] is True
    assert "".join(line["message"]["content"] for line in lines) == "Hello there!"
    assert {line["message"]["role"] for line in lines} == {"assistant"}
    final = lines[-1]
    assert final["done_reason"] == "stop" and final["message"]["content"] == ""
    assert all(isinstance(final[k], int) for k in TIMINGS) and final["eval_count"] == 4


def test_ollama_client_stream_adds_up(llama):
    parts = list(llama.chat(model=LISTED, messages=ASK, stream=True))
    assert "".join(p.message.content for p in parts) == "Hello there!" and parts[-1].done_reason == "stop"


def test_load_and_unload_calls_answer_at_once(llama, carded, stage):
    assert llama.chat(model=LISTED, messages=[]).done_reason == "load"
    r = llama.generate(model=LISTED)
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    assert llama.generate(model=LISTED, keep_alive=0).done_reason == "unload"
    assert llama.generate(model=LISTED, keep_alive="0s").done_reason == "unload"
    assert _lines(httpx.post(f"{carded.url}/api/generate", json={"model": LISTED}))[0]["done_reason"] == "load"
    assert stage.requests == []


# ------------------------------------------------------------------ generate


def test_generate_renders_system_and_prompt_with_the_chat_template(llama, carded, stage):
    r = llama.generate(model=LISTED, prompt="What is the weather in Paris?", system="Be brief.")
    assert (r.response, r.done_reason, r.eval_count) == ("Hello there!", "stop", 4)
    sent = list(_sent(stage).prompt_token_ids)
    assert r.prompt_eval_count == len(sent)
    assert _chat_prompt(carded, stage, {"messages": [{"role": "system", "content": "Be brief."}, *ASK]}) == sent


def test_generate_streamed(llama, carded, stage):
    parts = list(llama.generate(model=LISTED, prompt="Hi", stream=True))
    assert "".join(p.response for p in parts) == "Hello there!"
    assert parts[-1].done and parts[-1].done_reason == "stop" and parts[-1].eval_count == 4
    lines = _lines(httpx.post(f"{carded.url}/api/generate", json={"model": LISTED, "prompt": "Hi"}, timeout=20))
    assert "message" not in lines[0] and "".join(line["response"] for line in lines) == "Hello there!"


def test_raw_generate_sends_the_prompt_as_written(llama, stage, tokenizer):
    r = llama.generate(model=LISTED, prompt="<|im_start|>user\nHi<|im_end|>\n", raw=True, options={"num_predict": 2})
    assert list(_sent(stage).prompt_token_ids) == tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n")
    assert (r.response, r.done_reason, _sent(stage).max_tokens) == ("Hello there", "length", 2)
    with pytest.raises(ollama.ResponseError) as e:
        llama.generate(model=LISTED, prompt="Hi", raw=True, system="Be brief.")
    assert e.value.status_code == 400 and "system" in e.value.error


# ------------------------------------------------------------------ tools and formats


def test_tool_call_comes_back_with_arguments_as_an_object_and_the_round_trip(llama, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        add_special_tokens=False)
    r = llama.chat(model=LISTED, messages=ASK, tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
    assert r.message.content == "Let me check." and r.done_reason == "stop"
    stage.script.reply_ids = tokenizer.encode("It is sunny.", add_special_tokens=False)
    history = [*ASK, r.message, {"role": "tool", "content": "18 degrees, sunny", "tool_name": "get_weather"}]
    answer = llama.chat(model=LISTED, messages=history, tools=[WEATHER])
    assert answer.message.content == "It is sunny." and not answer.message.tool_calls
    rendered = tokenizer.decode(list(_sent(stage).prompt_token_ids))
    assert '"city": "Oslo"' in rendered and "18 degrees, sunny" in rendered  # the call and its result


def test_streamed_tool_call_is_sent_once_whole(carded, stage, tokenizer, healthy_mesh):
    stage.script.reply_ids = tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', add_special_tokens=False)
    lines = _lines(httpx.post(f"{carded.url}/api/chat", timeout=20,
                              json={"model": LISTED, "messages": ASK, "tools": [WEATHER]}))
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["function"]["arguments"] == {"city": "Oslo"} and calls[0]["function"]["index"] == 0
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop"


def test_a_final_assistant_message_is_continued(llama, stage, tokenizer):
    llama.chat(model=LISTED, messages=[*ASK, {"role": "assistant", "content": "The weather is"}])
    assert tokenizer.decode(list(_sent(stage).prompt_token_ids)).endswith("The weather is")  # no end of turn


def test_python_functions_as_tools(llama, carded, stage, tokenizer):
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
          city: The city
        """
        return "sunny"

    stage.script.reply_ids = tokenizer.encode(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', add_special_tokens=False)
    r = llama.chat(model=LISTED, messages=ASK, tools=[get_weather])
    assert r.message.tool_calls[0].function.arguments == {"city": "Oslo"}
    untyped = {"function": WEATHER["function"]}  # Ollama takes a tool without its "type" as a function
    r = httpx.post(f"{carded.url}/api/chat", timeout=20, json={"messages": ASK, "tools": [untyped], "stream": False})
    assert r.json()["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_format_schema_and_json_reach_the_stage_as_a_grammar(llama, stage, tokenizer):
    stage.script.reply_ids = tokenizer.encode('{"ok": true}', add_special_tokens=False)
    schema = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    r = llama.chat(model=LISTED, messages=ASK, format=schema)
    assert "ok" in _sent(stage).sampling.grammar and json.loads(r.message.content) == {"ok": True}
    r = llama.generate(model=LISTED, prompt="Answer in JSON.", format="json")
    assert _sent(stage).sampling.grammar and json.loads(r.response) == {"ok": True}
    llama.generate(model=LISTED, prompt="{", raw=True, format=schema)
    assert "ok" in _sent(stage).sampling.grammar


# ------------------------------------------------------------------ options


def test_options_map_onto_the_stages_sampling(llama, stage):
    r = llama.chat(model=LISTED, messages=ASK, options={
        "temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.05, "seed": 42, "repeat_penalty": 1.2,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_predict": 50, "stop": ["there"]})
    sent = _sent(stage)
    s = sent.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, sent.max_tokens) == (0.25, 0.5, 7, 42, 50)
    assert (round(s.min_p, 4), round(s.repetition_penalty, 4)) == (0.05, 1.2)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, 0.25)
    assert r.message.content == "Hello " and r.done_reason == "stop"  # cut at the stop string


def test_num_predict_until_the_context_is_full(llama, stage):
    for options in ({}, {"num_predict": -1}, {"num_predict": -2}, {"num_predict": 100_000}):
        r = llama.chat(model=LISTED, messages=ASK, options=options)
        sent = _sent(stage)
        assert sent.max_tokens == 2048 - len(sent.prompt_token_ids), options  # the room the context leaves
        assert r.done_reason == "stop"
    r = llama.chat(model=LISTED, messages=ASK, options={"num_predict": 2})
    assert (r.message.content, r.done_reason) == ("Hello there", "length")


def test_num_ctx_is_the_requests_own_context(llama, stage):
    r = llama.chat(model=LISTED, messages=ASK, options={"num_ctx": 2048})
    assert _sent(stage).max_tokens == 2048 - len(_sent(stage).prompt_token_ids)
    prompt = len(_sent(stage).prompt_token_ids)
    r = llama.chat(model=LISTED, messages=ASK, options={"num_ctx": prompt + 2, "num_predict": 1000})
    assert _sent(stage).max_tokens == 2 and (r.message.content, r.done_reason) == ("Hello there", "length")
    with pytest.raises(ollama.ResponseError) as e:
        llama.chat(model=LISTED, messages=ASK, options={"num_ctx": prompt})
    assert e.value.status_code == 400 and "options.num_ctx" in e.value.error and str(prompt) in e.value.error


def test_options_that_do_not_apply_are_accepted_and_ignored(llama, stage):
    ignored = {"num_gpu": 99, "num_thread": 8, "num_batch": 512, "use_mmap": True, "use_mlock": False, "numa": False,
               "main_gpu": 0, "low_vram": False, "num_keep": 4, "repeat_last_n": 64, "penalize_newline": True,
               "f16_kv": True, "vocab_only": False, "logits_all": False, "embedding_only": False,
               "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "tfs_z": 1.0, "typical_p": 1.0}
    assert llama.chat(model=LISTED, messages=ASK, options=ignored).message.content == "Hello there!"


def test_think_switches_a_reasoning_template_and_returns_the_thinking(mesh, tokenizer, eos_ids, stage, healthy_mesh):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                "{% else %}<think>\n{% endif %}{% endif %}")
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048,
                           openai=OpenAIDefaults(chat_template=template))
    server = AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
    try:
        client = ollama.Client(host=server.url, timeout=20)
        assert "thinking" in client.show(LISTED).capabilities
        stage.script.reply_ids = tokenizer.encode("Paris is in France.</think>\n\nHello there!",
                                                  add_special_tokens=False)
        r = client.chat(model=LISTED, messages=ASK, think=True)
        assert (r.message.thinking, r.message.content) == ("Paris is in France.", "Hello there!")
        parts = list(client.chat(model=LISTED, messages=ASK, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "Paris is in France."
        assert "".join(p.message.content for p in parts) == "Hello there!"
        g = client.generate(model=LISTED, prompt="Hi", think=True)
        assert (g.thinking, g.response) == ("Paris is in France.", "Hello there!")
        stage.script.reply_ids = tokenizer.encode("Hello there!", add_special_tokens=False)
        r = client.chat(model=LISTED, messages=ASK, think=False)
        assert tokenizer.decode(list(_sent(stage).prompt_token_ids)).endswith("</think>\n\n")
        assert r.message.content == "Hello there!" and not r.message.thinking
    finally:
        server.stop()


def test_logprobs_are_asked_of_the_stage(llama, stage):
    r = llama.chat(model=LISTED, messages=ASK, logprobs=True, top_logprobs=2)
    assert _sent(stage).sampling.logprobs == 2 and r.message.content == "Hello there!"


# ------------------------------------------------------------------ refusals and errors


@pytest.mark.parametrize("body, named", [
    ({"messages": ASK, "options": {"mirostat_mode": 1}}, "options.mirostat_mode"),
    ({"messages": ASK, "options": {"mirostat": 2}}, "options.mirostat"),
    ({"messages": ASK, "options": {"typical_p": 0.5}}, "options.typical_p"),
    ({"messages": ASK, "options": {"num_ctx": 4096}}, "options.num_ctx"),
    ({"messages": ASK, "options": {"temperature": 3}}, "options.temperature"),
    ({"messages": ASK, "options": {"temperature": "hot"}}, "options.temperature"),
    ({"messages": ASK, "options": {"num_predict": "many"}}, "options.num_predict"),
    ({"messages": ASK, "options": {"stop": ["a", "b", "c", "d", "e"]}}, "options.stop"),
    ({"messages": [{"role": "user", "content": "What is this?", "images": ["aGVsbG8="]}]}, "messages[0].images"),
    ({"messages": ASK, "format": "yaml"}, "format"),
    ({"messages": ASK, "format": {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}},
     "format cannot be enforced"),
    ({"messages": ASK, "think": True}, "does not support thinking"),
    ({"messages": ASK, "think": "deep"}, "think"),
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, "tools"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": ASK, "mystery": 1}, "mystery"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": ASK, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                     "arguments": 3}}]}, *ASK]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_chat_input_is_a_400_naming_the_field_and_reaches_no_stage(carded, stage, healthy_mesh, body, named):
    message = _post(carded, "/api/chat", {"model": LISTED, "stream": False, **body})
    assert named in message, message
    assert stage.requests == []


@pytest.mark.parametrize("body, named", [
    ({"prompt": "Hi", "images": ["aGVsbG8="]}, "images"),
    ({"prompt": "def f(", "suffix": "    return x"}, "suffix"),
    ({"prompt": "Hi", "template": "{{ .Prompt }}"}, "template"),
    ({"prompt": "Hi", "context": [1, 2, 3]}, "context"),
    ({"prompt": "Hi", "width": 512}, "width"),
    ({"prompt": "Hi", "options": {"seeds": 1}}, "options.seeds"),
    ({"prompt": "Hi", "raw": True, "think": True}, "think"),
    ({"prompt": "Hi", "raw": True, "options": {"temperature": 5}}, "options.temperature"),
    ({"prompt": "Hi", "raw": True, "options": {"temperature": "hot"}}, "options.temperature"),
])
def test_bad_generate_input_is_a_400_naming_the_field(carded, stage, healthy_mesh, body, named):
    message = _post(carded, "/api/generate", {"model": LISTED, **body})
    assert named in message, message
    assert stage.requests == []


def test_a_prompt_over_the_context_names_the_numbers(carded, stage, healthy_mesh):
    message = _post(carded, "/api/chat", {"model": LISTED, "messages": [{"role": "user", "content": "word " * 2100}]})
    assert "2048" in message and "input tokens" in message, message


def test_unknown_model_is_ollamas_404_naming_the_served_one(carded, stage, healthy_mesh):
    for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "Hi"}), ("/api/show", {})):
        message = _post(carded, path, {"model": "llama3.2", **body}, status=404)
        assert 'model "llama3.2" not found' in message and LISTED in message, message
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=carded.url).chat(model="llama3.2", messages=ASK)
    assert e.value.status_code == 404


def test_malformed_bodies_are_400s_in_ollamas_shape(carded, stage, healthy_mesh):
    for path in ("/api/chat", "/api/generate", "/api/show"):
        message = _error(httpx.post(f"{carded.url}{path}", content=b'{"model": "x", "messages": [', timeout=20), 400)
        assert "not valid JSON" in message, message
        assert "missing request body" in _error(httpx.post(f"{carded.url}{path}", content=b"", timeout=20), 400)
    ndjson = b'{"model": "m", "messages": []}\n{"model": "m"}\n'
    assert "not valid JSON" in _error(httpx.post(f"{carded.url}/api/chat", content=ndjson), 400)
    assert "body" in _error(httpx.post(f"{carded.url}/api/chat", json=["not", "an", "object"]), 400)
    assert stage.requests == []


def test_a_body_sent_as_a_form_is_read_as_json(carded, stage, healthy_mesh):
    """Ollama's own docs send bodies with `curl -d`, whose Content-Type is a form's."""
    body = json.dumps({"model": LISTED, "prompt": "Hi", "stream": False})
    r = httpx.post(f"{carded.url}/api/generate", content=body, timeout=20,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["response"] == "Hello there!"


@pytest.mark.parametrize("method, path, named", [
    ("POST", "/api/embed", "embeddings"), ("POST", "/api/embeddings", "embeddings"),
    ("POST", "/api/pull", "stagemesh serve MODEL"), ("POST", "/api/push", "pushes no models"),
    ("POST", "/api/create", "stagemesh serve MODEL"), ("POST", "/api/copy", "--served-model-name"),
    ("DELETE", "/api/delete", "stop `stagemesh serve`"), ("POST", "/api/blobs/sha256:abc", "blobs"),
])
def test_what_stagemesh_does_otherwise_is_refused_naming_it(carded, stage, healthy_mesh, method, path, named):
    r = httpx.request(method, f"{carded.url}{path}", json={"model": LISTED, "input": "x"}, timeout=20)
    assert named in _error(r, 501)


def test_the_clients_own_calls_raise_its_response_error(llama):
    with pytest.raises(ollama.ResponseError) as e:
        llama.pull(LISTED)
    assert e.value.status_code == 501 and "stagemesh serve" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        llama.embed(model=LISTED, input="Hi")
    assert e.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as e:
        llama.create(model="mine", from_=LISTED)
    assert e.value.status_code == 501
    with pytest.raises(ollama.ResponseError) as e:
        llama.delete(LISTED)
    assert e.value.status_code == 501


def test_unknown_routes_and_methods_under_api_are_ollamas_shape(carded):
    assert "Not found" in _error(httpx.get(f"{carded.url}/api/nothing"), 404)
    assert "not allowed" in _error(httpx.get(f"{carded.url}/api/chat"), 405)


def test_a_failure_mid_stream_is_an_error_line(carded, stage, healthy_mesh, llama):
    stage.script.fail_after_tokens = 2
    lines = _lines(httpx.post(f"{carded.url}/api/chat", json={"model": LISTED, "messages": ASK}, timeout=20))
    assert "error" in lines[-1] and not any(line.get("done") for line in lines[:-1])
    with pytest.raises(ollama.ResponseError):
        list(llama.chat(model=LISTED, messages=ASK, stream=True))


def test_a_mesh_that_cannot_serve_is_a_503_before_any_line(carded, stage, healthy_mesh):
    healthy_mesh.healthy[0] = False
    message = _error(httpx.post(f"{carded.url}/api/chat", json={"model": LISTED, "messages": ASK}, timeout=20), 503)
    assert "healthy replica" in message


def test_the_key_guards_api_as_it_guards_v1(keyed_server, stage, healthy_mesh):
    assert "API key" in _error(httpx.get(f"{keyed_server.url}/api/tags"), 401)
    assert "API key" in _error(httpx.post(f"{keyed_server.url}/api/chat", json={"messages": ASK}), 401)
    good = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=20)
    assert good.chat(model=LISTED, messages=ASK).message.content == "Hello there!"
    assert good.list().models[0].model == LISTED


def test_the_limits_guard_api_in_ollamas_shape(mesh, tokenizer, eos_ids, stage, healthy_mesh):
    config = GatewayConfig(served_model_name=MODEL, max_model_len=2048, max_request_bytes=200)
    server = AppServer(create_app(config, mesh=mesh, tokenizer=tokenizer, eos_token_ids=eos_ids)).start()
    try:
        long = {"model": LISTED, "messages": [{"role": "user", "content": "word " * 100}]}
        assert "--max-request-bytes" in _post(server, "/api/chat", long, status=413)
    finally:
        server.stop()


def test_metrics_count_ollamas_generations(carded, llama, stage):
    def scrape() -> dict[str, float]:
        rows = httpx.get(f"{carded.url}/metrics", timeout=10).text.splitlines()
        return {r.rsplit(" ", 1)[0]: float(r.rsplit(" ", 1)[1]) for r in rows if r and not r.startswith("#")}

    before = scrape()
    llama.chat(model=LISTED, messages=ASK)
    after = scrape()
    key = 'stagemesh_gateway_requests_total{endpoint="/api/chat",status="200"}'
    assert after[key] == before.get(key, 0) + 1


# ------------------------------------------------------------------ Open WebUI


def test_open_webuis_request_sequence(carded, stage, healthy_mesh, tokenizer):
    """What Open WebUI's Ollama connection sends: the version check, the model list, the model's details, then
    a streamed chat with the options its model settings hold (`keep_alive` and `format` as it passes them)."""
    base = carded.url
    with httpx.Client(base_url=base, timeout=20, headers={"Content-Type": "application/json"}) as web:
        assert web.get("/api/version").json()["version"] == "0.12.0"
        (model,) = web.get("/api/tags").json()["models"]
        shown = web.post("/api/show", json={"model": model["model"]}).json()
        assert "completion" in shown["capabilities"] and shown["model_info"]["llama.context_length"] == 2048
        body = {"model": model["model"], "stream": True, "keep_alive": "5m",
                "messages": [{"role": "system", "content": "You are a helpful assistant."},
                             {"role": "user", "content": "Hi", "images": []}],
                "options": {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "num_ctx": 2048, "num_predict": 128,
                            "repeat_penalty": 1.1, "seed": 7, "stop": ["<|im_end|>"]}}
        with web.stream("POST", "/api/chat", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "".join(line["message"]["content"] for line in lines) == "Hello there!"
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] == 4
    sampling = _sent(stage).sampling
    assert (sampling.top_k, sampling.seed, _sent(stage).max_tokens) == (40, 7, 128)
    assert sampling.temperature == pytest.approx(0.8) and sampling.repetition_penalty == pytest.approx(1.1)
