"""/openapi.json tells the truth, and a bounded schemathesis pass finds no server error, no undocumented
status and no undocumented content type (real gateway, real tokenizer, a fake stage behind it)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from gateway.anthropic.protocol import CountTokensRequest
from gateway.http.schema import RUNTIME_RULES
from gateway.openai_responses.protocol import InputTokensRequest


@pytest.fixture
def document(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


def test_statuses_and_content_types_are_the_real_ones(document):
    for path, operations in document["paths"].items():
        envelope = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            assert responses["500"]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{envelope}"}
            if method == "post":
                assert "400" in responses, (method, path)
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        generation = document["paths"][path]["post"]["responses"]
        assert {"401", "404", "503", "504"} <= set(generation) and "text/event-stream" in generation["200"]["content"]
    assert "HTTPValidationError" not in document["components"]["schemas"]
    anthropic = document["components"]["schemas"]["AnthropicErrorResponse"]
    assert anthropic["properties"]["type"] == {"const": "error"}


def test_request_schemas_are_as_tight_as_the_validation(document):
    schemas = document["components"]["schemas"]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant",
                                                                    "tool"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert prompt[1]["items"]["maximum"] == 49151  # the vocabulary of the served model
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert (chat["temperature"]["minimum"], chat["temperature"]["maximum"]) == (0, 2)
    assert chat["max_tokens"]["maximum"] == 2047 and chat["top_logprobs"]["maximum"] == 20
    assert chat["min_tokens"]["maximum"] == 2047 and chat["max_completion_tokens"]["maximum"] == 2047
    keys = re.compile(chat["logit_bias"]["propertyNames"]["pattern"])  # token ids as keys: 0 .. 49151
    assert keys.match("0") and keys.match("49151") and keys.match("10000")
    assert not keys.match("49152") and not keys.match("007") and not keys.match("-1")
    assert chat["use_beam_search"]["enum"] == [False, None] and chat["audio"]["type"] == "null"
    rules = {r["rule"] for r in schemas["ChatCompletionRequest"]["x-runtime-rules"]}
    assert "prompt-fits-context" in rules and "grammar-compiles" in rules


def test_rules_between_fields_are_json_schema(document):
    """A validator reading /openapi.json alone refuses what the gateway refuses for breaking a rule between
    fields (and accepts its neighbours)."""
    chat = _validator(document, {"$ref": "#/components/schemas/ChatCompletionRequest"})
    messages = [{"role": "user", "content": "Hi"}]
    refused = [{"stream_options": {"include_usage": True}},
               {"guided_regex": "a+", "guided_choice": ["a"]},
               {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
               {"guided_regex": "a+", "ignore_eos": True}, {"guided_regex": "a+", "min_tokens": 2},
               {"tool_choice": "auto"}, {"parallel_tool_calls": False}, {"top_logprobs": 2},
               {"continue_final_message": True, "add_generation_prompt": True}, {"reasoning_effort": "low"}]
    accepted = [{"stream_options": {"include_usage": True}, "stream": True}, {"guided_regex": "a+"},
                {"response_format": {"type": "text"}, "guided_json": {"type": "object"}},
                {"guided_regex": "a+", "ignore_eos": False, "min_tokens": 0},
                {"tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
                {"top_logprobs": 2, "logprobs": True}, {"continue_final_message": True}]
    for fields in refused:
        assert not chat.is_valid({"messages": messages, **fields}), fields
    for fields in accepted:
        assert chat.is_valid({"messages": messages, **fields}), fields
    assert not chat.is_valid({"messages": [{"role": "tool"}]})  # only the assistant may leave out content
    assert chat.is_valid({"messages": [{"role": "assistant"}]})


_CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
           checks.positive_data_acceptance]
_GENERATION = ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"]
_CHATS = ["/v1/chat/completions", "/tokenize"]
_MESSAGES = ["/v1/messages", "/v1/messages/count_tokens"]
_RESPONSES = ["/v1/responses", "/v1/responses/input_tokens"]
_TOOL_CALLERS = ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", *_RESPONSES]
MAX_MODEL_LEN = 2048  # the session server's (conftest)


def _budget(body: dict) -> int | None:
    given = body.get("max_completion_tokens")
    return given if given is not None else body.get("max_tokens", body.get("max_output_tokens"))


def _chat(body: dict) -> bool:
    return isinstance(body, dict) and "messages" in body


def _compiles(kind: str, value: Any) -> bool:
    """llguidance compiles it: the rule itself, asked of llguidance directly."""
    from llguidance import LLMatcher

    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(value)
        else:
            grammar = LLMatcher.grammar_from_lark(value)
    except (ValueError, TypeError, RuntimeError):
        return False
    return not LLMatcher.validate_grammar(grammar)


def _functions(path: str, body: dict) -> list[tuple[str, dict | None]]:
    """The functions a request offers the model: (name as offered, parameters)."""
    tools = body.get("tools") or []
    if path in _MESSAGES:
        return [(t["name"], t["input_schema"]) for t in tools]
    if path in _RESPONSES:
        return [(f"{t['name']}__{f['name']}" if t["type"] == "namespace" else f["name"], f.get("parameters"))
                for t in tools if t["type"] in ("function", "namespace")
                for f in (t["tools"] if t["type"] == "namespace" else [t])]
    return [(t["function"]["name"], t["function"].get("parameters", {})) for t in tools]


def _forced(path: str, body: dict) -> bool:
    choice = body.get("tool_choice")
    if path in _MESSAGES:
        return isinstance(choice, dict) and choice["type"] in ("any", "tool")
    return choice == "required" or isinstance(choice, dict)


def _grammars(path: str, body: dict) -> list[tuple[str, Any]]:
    if path in _MESSAGES or path in _RESPONSES:
        fmt = (body.get("output_config") if path in _MESSAGES else body.get("text")) or {}
        fmt = fmt.get("format") or {}
        found = [("json", fmt["schema"])] if fmt.get("type") == "json_schema" else []
        if _forced(path, body):
            found += [("json", parameters or {}) for _, parameters in _functions(path, body)]
        return found
    found = [(k, body.get(f"guided_{k}")) for k in ("json", "regex", "grammar")]
    found += list((body.get("structured_outputs") or {}).items())
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        found.append(("json", fmt["json_schema"]["schema"]))
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        found += [("json", t["function"].get("parameters", {})) for t in body.get("tools") or []]
    return [(k, v) for k, v in found if v is not None and k != "choice"]


def _prompt_tokens(server_url: str, tokenizer, path: str, body: dict) -> list[int] | None:
    """Each prompt's token count as the endpoint counts it (a chat's through POST /tokenize, which renders
    exactly as the chat endpoint does); None when /tokenize refuses it (another rule's business)."""
    if path in ("/v1/messages", "/v1/responses"):
        counter, fields = (("/v1/messages/count_tokens", CountTokensRequest) if path == "/v1/messages"
                           else ("/v1/responses/input_tokens", InputTokensRequest))
        r = httpx.post(f"{server_url}{counter}", json={k: v for k, v in body.items() if k in fields.model_fields},
                       timeout=30)
        return [r.json()["input_tokens"]] if r.status_code == 200 else None
    if path == "/v1/completions":
        prompt = body["prompt"]
        single = isinstance(prompt, str) or isinstance(prompt[0], int | float)  # 3.0 is an integer too
        special = body.get("add_special_tokens") is not False
        return [len(tokenizer.encode(p, add_special_tokens=special)) if isinstance(p, str) else len(p)
                for p in ([prompt] if single else prompt)]
    keys = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
            "add_special_tokens")
    chat = {k: body[k] for k in keys if body.get(k) is not None}
    if body.get("tools") and body.get("tool_choice") != "none":  # "none": the tools are not shown to the model
        chat["tools"] = body["tools"]
    r = httpx.post(f"{server_url}/tokenize", json=chat, timeout=30)
    return [r.json()["count"]] if r.status_code == 200 else None


def _runtime_rules(server_url: str, tokenizer) -> dict[str, tuple[list[str], Callable[[str, dict], bool]]]:
    """Each rule JSON Schema cannot say (``x-runtime-rules``): the paths it holds on, and whether a body keeps it."""

    def fits(path: str, body: dict) -> bool:
        counts = _prompt_tokens(server_url, tokenizer, path, body)
        budget = _budget(body) or 1
        return counts is None or all(0 < count and count + budget <= MAX_MODEL_LEN for count in counts)

    def min_tokens(_path: str, body: dict) -> bool:
        return body.get("min_tokens") is None or _budget(body) is None or body["min_tokens"] <= _budget(body)

    def tools(path: str, body: dict) -> list[str]:
        return [name for name, _ in _functions(path, body)]

    def distinct(path: str, body: dict) -> bool:
        names = tools(path, body)
        return path == "/tokenize" and not _chat(body) or len(set(names)) == len(names)

    def named(path: str, body: dict) -> bool:
        choice = body.get("tool_choice")
        if not isinstance(choice, dict) or (path in _MESSAGES and choice["type"] != "tool"):
            return True
        return (choice["function"]["name"] if "function" in choice else choice["name"]) in tools(path, body)

    def answers_tool_use(_path: str, body: dict) -> bool:
        asked: set[str] = set()
        for message in body["messages"]:
            blocks = message["content"] if isinstance(message["content"], list) else []
            if message["role"] == "user" and any(b["type"] == "tool_result" and b["tool_use_id"] not in asked
                                                 for b in blocks):
                return False
            if message["role"] != "system":  # a system message between a call and its result changes nothing
                asked = {b["id"] for b in blocks if message["role"] == "assistant" and b["type"] == "tool_use"}
        return True

    def answers_call(_path: str, body: dict) -> bool:
        called: set[str] = set()
        for item in body["input"] if isinstance(body["input"], list) else []:
            if item.get("type") == "function_call":
                called.add(item["call_id"])
            elif item.get("type") == "function_call_output" and item["call_id"] not in called:
                return False
        return True

    def names_fit(path: str, body: dict) -> bool:
        return all(len(name) <= 64 for name in tools(path, body))

    def renders(_path: str, body: dict) -> bool:
        """The test writes no Jinja: plain text always renders, but never holds the final message to continue."""
        template = body.get("chat_template") if _chat(body) else None
        return not template or not (any(mark in template for mark in ("{{", "{%", "{#"))
                                    or body.get("continue_final_message"))

    def continues(_path: str, body: dict) -> bool:
        return (not _chat(body) or not body.get("continue_final_message")
                or body["messages"][-1]["role"] == "assistant")

    return {
        "prompt-fits-context": (_GENERATION, fits),
        "min-tokens-within-max-tokens": (_GENERATION, min_tokens),
        "grammar-compiles": ([*_GENERATION, _MESSAGES[1], _RESPONSES[1]],
                             lambda path, body: all(_compiles(k, v) for k, v in _grammars(path, body))),
        "chat-template-renders": (_CHATS, renders),
        "tool-names-distinct": ([*_CHATS, *_MESSAGES, *_RESPONSES], distinct),
        "tool-choice-names-a-tool": (_TOOL_CALLERS, named),
        "continue-final-message-after-assistant": (_CHATS, continues),
        "tool-result-answers-a-tool-use": (_MESSAGES, answers_tool_use),
        "function-call-output-answers-a-call": (_RESPONSES, answers_call),
        "namespaced-names-fit": (_RESPONSES, names_fit),
    }


def test_schemathesis_finds_no_server_error_no_undocumented_status_and_accepts_valid_requests(
        server, stage, healthy_mesh, tokenizer, document):
    """Every operation, a bounded number of generated requests each (schemathesis' pytest plugin does not run
    under this pytest, so the operations are driven through hypothesis directly), and every request valid for
    the document is accepted, except where it breaks one of the rules the document names in ``x-runtime-rules``
    (JSON Schema cannot say them): each is a filter of its own, on the operations it concerns.

    Requests are drawn from each field's schema and kept when they are valid for the whole document, its rules
    between fields included (``allOf`` of each request schema): schemathesis' generator expands such rules into
    every combination of their alternatives and gives up beyond a few (jsonschema-rs' canonical form), while
    three in four drawn requests already keep them."""
    from hypothesis import given

    fields_only = copy.deepcopy(document)
    for model in fields_only["components"]["schemas"].values():
        model.pop("allOf", None)
    schema = schemathesis.openapi.from_dict(fields_only)
    documented = {r["rule"] for model in document["components"]["schemas"].values()
                  for r in model.get("x-runtime-rules", [])}
    rules = _runtime_rules(server.url, tokenizer)
    assert documented == set(RUNTIME_RULES) == set(rules)
    for path, operations in document["paths"].items():
        if "requestBody" in operations.get("post", {}):
            schema.hook("filter_case").apply_to(method="POST", path=path)(_valid_for(document, path))
    for name, (paths, keep) in rules.items():
        for path in paths:
            schema.hook("filter_case").apply_to(method="POST", path=path)(_rule_filter(name, path, keep))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        @given(operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case):
            case.call_and_validate(base_url=server.url, checks=_CHECKS,
                                   excluded_checks=[c for c in _ALL if c not in _CHECKS])

        run()


def _validator(document: dict, schema: dict) -> Any:
    """A JSON Schema (2020-12) validator of ``schema``, whose references point into the document's components."""
    from jsonschema import Draft202012Validator

    def local(node: Any) -> Any:
        return json.loads(json.dumps(node).replace("#/components/schemas/", "#/$defs/"))

    return Draft202012Validator({"$defs": local(document["components"]["schemas"]), **local(schema)})


def _valid_for(document: dict, path: str) -> Callable:
    """Keeps a request body valid for the document's schema of ``path``, its rules between fields included."""
    validator = _validator(document, document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
                           ["schema"])

    def filter_case(_context, case) -> bool:
        return validator.is_valid(case.body)

    filter_case.__qualname__ = f"filter_case[valid for the document on {path}]"
    return filter_case


def _rule_filter(rule: str, path: str, keep: Callable[[str, dict], bool]) -> Callable:
    def filter_case(_context, case) -> bool:
        return not isinstance(case.body, dict) or keep(path, case.body)

    filter_case.__qualname__ = f"filter_case[{rule} on {path}]"
    return filter_case


_ALL = [checks.positive_data_acceptance, checks.negative_data_rejection, checks.response_schema_conformance,
        checks.missing_required_header, checks.unsupported_method, checks.use_after_free,
        checks.ensure_resource_availability, checks.ignored_auth, checks.response_headers_conformance,
        checks.max_response_time]
