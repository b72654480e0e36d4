"""The clients people point at a local model, against a real ``stagemesh serve`` at PP=2 with the real model:
the ``anthropic`` and ``openai`` SDKs on the Messages and Responses APIs (plain, streamed, a forced tool call and
its round trip), the ``ollama`` client on Ollama's API at ``--ollama-port`` (the model described, chat and
generate plain and streamed, a tool call, structured output), and the coding-agent CLIs from npm, Claude Code
(``claude -p``) and Codex CLI (``codex exec``), each set up by its own documented settings and answering a
one-line prompt. One server for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.conftest import free_port_base
from tests.e2e.serve_process import assert_stops_clean, start_serve

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "agent-clients-key"
GREEDY = {"temperature": 0}  # read from the JSON body: anthropic's create() takes no temperature argument
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 40},
                                 "unit": {"enum": ["celsius", "fahrenheit"]}}}
CLAUDE = shutil.which("claude")
CODEX = shutil.which("codex")
AGENT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def ollama_port() -> int:
    return free_port_base(1)


@pytest.fixture(scope="module")
def serve(tmp_path_factory, ollama_port):
    # The agents send no sampling settings and Codex no token budget: the server's defaults (--generation-config)
    # make their one-line answers greedy and short. The SDK tests send their own.
    defaults = tmp_path_factory.mktemp("generation-config")
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 48}))
    s = start_serve(tmp_path_factory.mktemp("agent-clients"), "--api-key", API_KEY, "--generation-config",
                    str(defaults), "--ollama-port", str(ollama_port), pp=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude_sdk(serve) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=serve.url, api_key=API_KEY, max_retries=0, timeout=AGENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def openai_sdk(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=AGENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def ollama_client(serve, ollama_port) -> ollama.Client:
    """Ollama's own client on the Ollama port, as tools that assume localhost:11434 reach it (the key as a
    bearer token, as OLLAMA_API_KEY sends it)."""
    return ollama.Client(host=f"http://127.0.0.1:{ollama_port}", headers={"Authorization": f"Bearer {API_KEY}"},
                         timeout=AGENT_TIMEOUT_S)


def _served(serve, endpoint: str) -> float:
    """Requests the gateway answered 200 on ``endpoint`` (its Prometheus counter)."""
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    line = f'stagemesh_gateway_requests_total{{endpoint="{endpoint}",status="200"}}'
    return sum(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line))


def test_messages_plain_and_streamed_give_the_same_answer(claude_sdk):
    kwargs = dict(model=MODEL, max_tokens=24, system="Be brief.", messages=[{"role": "user", "content": "Say hi."}],
                  extra_body=GREEDY)
    plain = claude_sdk.messages.create(**kwargs)
    with claude_sdk.messages.stream(**kwargs) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert plain.content[0].type == "text" and plain.content[0].text
    assert streamed_text == streamed.content[0].text == plain.content[0].text
    assert plain.stop_reason == streamed.stop_reason and plain.stop_reason in ("end_turn", "max_tokens")
    # Anthropic counts cache reads apart from input_tokens: the repeated prompt is read from the prefix
    # cache the first call filled, so the two split the same prompt differently but sum to the same.
    prompt = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert prompt == streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens > 0
    assert streamed.usage.cache_read_input_tokens > 0 and streamed.usage.cache_creation_input_tokens == 0


def test_messages_tool_round_trip(claude_sdk):
    tool = {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA}
    first = claude_sdk.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[tool],
                                       tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    history = [*ASK, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "18 degrees celsius, sunny"}]}]
    answer = claude_sdk.messages.create(model=MODEL, max_tokens=60, messages=history, tools=[tool],
                                        tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_messages_streamed_tool_call_is_the_unstreamed_one(claude_sdk):
    tool = {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA}
    kwargs = dict(model=MODEL, max_tokens=80, messages=ASK, tools=[tool], tool_choice={"type": "any"},
                  extra_body=GREEDY)
    whole = claude_sdk.messages.create(**kwargs)
    with claude_sdk.messages.stream(**kwargs) as stream:
        pieces = [e.partial_json for e in stream if e.type == "input_json"]
        streamed = stream.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == whole.content[0].input == streamed.content[0].input
    assert streamed.stop_reason == whole.stop_reason == "tool_use"


def test_responses_plain_and_streamed_give_the_same_answer(openai_sdk):
    kwargs = dict(model=MODEL, instructions="Be brief.", input="Say hi.", max_output_tokens=24, temperature=0)
    plain = openai_sdk.responses.create(**kwargs)
    with openai_sdk.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    streamed = events[-1].response  # response.completed, or response.incomplete when the budget ran out
    assert events[-1].type == f"response.{streamed.status}" and streamed.status == plain.status
    assert plain.output_text and "".join(deltas) == streamed.output_text == plain.output_text


def test_responses_function_call_round_trip(openai_sdk):
    tool = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
            "parameters": WEATHER_SCHEMA, "strict": True}
    first = openai_sdk.responses.create(model=MODEL, input=ASK, tools=[tool], tool_choice="required",
                                        temperature=0, max_output_tokens=80)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    history = [*ASK, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees celsius, sunny"}]
    answer = openai_sdk.responses.create(model=MODEL, input=history, tools=[tool], tool_choice="none",
                                         temperature=0, max_output_tokens=60)
    assert answer.output_text and [item.type for item in answer.output] == ["message"]


def test_a_prompt_over_the_context_is_each_apis_own_error(claude_sdk, openai_sdk):
    long = [{"role": "user", "content": "word " * 9000}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude_sdk.messages.create(model=MODEL, max_tokens=16, messages=long)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "8192" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_sdk.responses.create(model=MODEL, input=long)
    assert e.value.body["param"] == "input" and "8192" in e.value.body["message"]


OLLAMA_GREEDY = {"temperature": 0, "num_predict": 24}
LISTED = f"{MODEL}:latest"


def test_ollama_port_lists_shows_and_runs_the_served_model(ollama_client, ollama_port):
    root = httpx.get(f"http://127.0.0.1:{ollama_port}/", timeout=10)
    assert (root.status_code, root.text) == (200, "Ollama is running")
    assert httpx.get(f"http://127.0.0.1:{ollama_port}/api/tags", timeout=10).status_code == 401  # the key, as /v1
    (listed,) = ollama_client.list().models
    assert listed.model == LISTED and listed.size > 0 and listed.digest
    assert (listed.details.family, listed.details.format) == ("llama", "gguf")
    assert (listed.details.parameter_size, listed.details.quantization_level) == ("134.52M", "Q4_1")
    shown = ollama_client.show(LISTED)
    assert shown.modelinfo["llama.context_length"] == 8192 and "completion" in shown.capabilities
    (running,) = ollama_client.ps().models
    assert running.model == LISTED and running.context_length == 8192


def test_ollama_chat_plain_and_streamed_give_the_same_answer(ollama_client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    plain = ollama_client.chat(model=LISTED, messages=messages, options=OLLAMA_GREEDY)
    parts = list(ollama_client.chat(model=LISTED, messages=messages, options=OLLAMA_GREEDY, stream=True))
    assert plain.message.content and "".join(p.message.content for p in parts) == plain.message.content
    assert plain.done_reason == parts[-1].done_reason and plain.done_reason in ("stop", "length")
    assert plain.eval_count == parts[-1].eval_count <= 24 and plain.prompt_eval_count > 0
    assert plain.total_duration >= plain.prompt_eval_duration + plain.eval_duration - 2 > 0


def test_ollama_generate_streamed_is_the_plain_answer(ollama_client):
    plain = ollama_client.generate(model=LISTED, prompt="Say hi.", options=OLLAMA_GREEDY)
    parts = list(ollama_client.generate(model=LISTED, prompt="Say hi.", options=OLLAMA_GREEDY, stream=True))
    assert plain.response and "".join(p.response for p in parts) == plain.response and parts[-1].done


def test_ollama_tool_call(ollama_client):
    """Ollama's API has no tool_choice: the call is the model's own, in its own format, read back. The default
    model makes one after an example call in the conversation (greedy, so always)."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                             "parameters": WEATHER_SCHEMA}}
    example = [{"role": "user", "content": "What is the weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}}]},
               {"role": "user", "content": "What is the weather in Paris?"}]
    r = ollama_client.chat(model=LISTED, messages=example, tools=[tool], options={"temperature": 0, "num_predict": 80})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and r.done_reason == "stop"
    jsonschema.validate(call.function.arguments, WEATHER_SCHEMA)  # an object, as Ollama sends it
    result = {"role": "tool", "content": "18 degrees celsius, sunny", "tool_name": "get_weather"}
    history = [*example, r.message, result]
    answer = ollama_client.chat(model=LISTED, messages=history, options={"temperature": 0, "num_predict": 40})
    assert answer.message.content and answer.done_reason in ("stop", "length")


def test_ollama_structured_output_fits_its_schema(ollama_client):
    r = ollama_client.chat(model=LISTED, messages=ASK, format=WEATHER_SCHEMA,
                           options={"temperature": 0, "num_predict": 60})
    assert r.done_reason == "stop", r
    jsonschema.validate(json.loads(r.message.content), WEATHER_SCHEMA)


def _agent_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    return {**env, "HOME": str(home), **extra}


def _claude(serve, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    if CLAUDE is None:
        pytest.skip("needs Claude Code (npm install -g @anthropic-ai/claude-code; .ci/run installs it)")
    env = _agent_env(tmp_path, ANTHROPIC_BASE_URL=serve.url, ANTHROPIC_API_KEY=API_KEY,
                     # The default model's context is 8,192 tokens: Claude Code asks for 32,000 by default.
                     CLAUDE_CODE_MAX_OUTPUT_TOKENS="64",
                     DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    return subprocess.run([CLAUDE, "-p", "Say hi in one short sentence.", "--model", MODEL, "--output-format", "json",
                           "--no-session-persistence", *flags], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)


def test_claude_code_answers_a_one_line_prompt(serve, tmp_path):
    before = _served(serve, "/v1/messages")
    # Its own short system prompt and no tools: the default ones alone are over the model's context.
    done = _claude(serve, tmp_path, "--bare", "--system-prompt", "You are brief.", "--tools", "",
                   "--disable-slash-commands")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["result"].strip(), result
    assert _served(serve, "/v1/messages") > before


def test_claude_code_with_its_default_prompt_gets_the_context_error(serve, tmp_path):
    done = _claude(serve, tmp_path)
    result = json.loads(done.stdout)
    assert result["is_error"] is True, result
    assert "maximum context length is 8192 tokens" in result["result"], result


def test_codex_exec_answers_a_one_line_prompt(serve, tmp_path):
    if CODEX is None:
        pytest.skip("needs Codex CLI (npm install -g @openai/codex; .ci/run installs it)")
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are brief.")
    work, codex_home = tmp_path / "work", tmp_path / ".codex"
    work.mkdir()
    codex_home.mkdir()
    provider = (f'{{name="stagemesh", base_url="{serve.url}/v1", env_key="STAGEMESH_API_KEY", wire_api="responses", '
                'request_max_retries=0, stream_max_retries=0}')
    settings = {"model_provider": "stagemesh", "model_providers.stagemesh": provider,
                # A short system prompt and few tools: Codex's defaults are over the model's context.
                "model_instructions_file": json.dumps(str(instructions)), "include_permissions_instructions": "false",
                "include_apps_instructions": "false", "include_environment_context": "false",
                "include_collaboration_mode_instructions": "false", "web_search": '"disabled"',
                "tools.experimental_request_user_input": "{enabled=false}", "model_context_window": "8192",
                "check_for_update_on_startup": "false", "analytics.enabled": "false"}
    disabled = ("multi_agent", "goals", "shell_tool", "plugins", "apps", "skill_search", "image_generation",
                "tool_suggest", "sleep_tool", "view_image")
    enabled = ("skip_host_skill_discovery", "omit_skill_descriptions")
    before = _served(serve, "/v1/responses")
    done = subprocess.run(
        [CODEX, "exec", "--json", "--skip-git-repo-check", "-C", str(work), "-m", MODEL,
         *(arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")),
         *(arg for feature in disabled for arg in ("--disable", feature)),
         *(arg for feature in enabled for arg in ("--enable", feature)), "Say hi in one short sentence."],
        env=_agent_env(tmp_path, CODEX_HOME=str(codex_home), STAGEMESH_API_KEY=API_KEY),
        cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failures = [e for e in events if e["type"] in ("turn.failed", "error")]
    assert done.returncode == 0 and not failures, done.stdout[-3000:] + done.stderr[-3000:]
    messages = [e["item"]["text"] for e in events
                if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    assert messages and messages[-1].strip(), events
    assert _served(serve, "/v1/responses") > before


def test_ctrl_c_to_the_process_group_stops_the_serve_and_leaves_nothing(serve):
    """What Ctrl-C in a terminal does. Runs last: it ends the module's serve."""
    assert_stops_clean(serve, "ctrl-c-to-group")
