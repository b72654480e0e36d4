"""A Responses API request as the core's chat request: pure functions, no I/O.

Contract: ``to_chat(req, thinking_switch=...)`` returns a ``ResponsesTranslation`` (the ``Translated`` chat
request, and the namespaced tools' names) or raises a 400 ``APIError`` naming the item or field.
``instructions`` and ``input`` become chat messages (``function_call`` / ``function_call_output`` items are
``tool_calls`` and ``tool`` messages), function tools and namespaces of them become chat's function tools
(a namespaced call comes back with ``namespace`` and ``name`` apart: ``ResponsesTranslation.call_name``), and
the sampling fields keep their meaning. What a stateless, text-only server cannot honour (``store: true``,
``previous_response_id``, ``conversation``, ``background``, logprobs, images, other tool types) is refused,
never dropped silently; ``reasoning`` items and ``web_search`` tools are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.chat.translation import FieldNames, Translated, chat_request
from gateway.http.errors import bad_request, unsupported

from .protocol import WEB_SEARCH_TYPES, InputTokensRequest, ResponsesRequest

NAMESPACE_SEPARATOR = "__"
MAX_OFFERED_NAME = 64  # the chat request's limit on a function's name (gateway.chat.request.TOOL_NAME_PATTERN)


@dataclass(frozen=True)
class ResponsesTranslation:
    translated: Translated
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # offered name -> (namespace, name)

    def call_name(self, offered: str) -> tuple[str | None, str]:
        """A call's ``(namespace, name)`` as the client declared the tool."""
        namespace, name = self.namespaced.get(offered, (None, offered))
        return namespace, name


def _text_parts(content: Any, where: str) -> list[dict[str, str]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts.", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{at} is an {kind} part; this server serves a text-only model.", f"{at}.type")
        if kind not in ("input_text", "output_text", "refusal") or not isinstance(part.get(key), str):
            raise bad_request(f"{at} must be an input_text, output_text or refusal part with its text.", at)
        parts.append({"type": "text", "text": part[key]})
    return parts


class _Conversation:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}
        self.calls: set[str] = set()
        self.open_calls = False  # the last message is an assistant's that further calls join

    def add(self, message: dict[str, Any], source: str, content_source: str) -> None:
        k = len(self.messages)
        self.messages.append(message)
        self.names[f"messages[{k}]"] = source
        self.names[f"messages[{k}].content"] = content_source
        self.open_calls = message["role"] == "assistant"


def _offered_name(item: dict[str, Any]) -> str:
    namespace = item.get("namespace")
    return f"{namespace}{NAMESPACE_SEPARATOR}{item['name']}" if namespace else item["name"]


def _input(req: InputTokensRequest, chat: _Conversation) -> None:
    """``input`` as messages. A string is one user message; as items: ``message`` items (roles user, system,
    developer, assistant; text parts) are messages, ``function_call`` items are the assistant's ``tool_calls``
    (calls in a row, and the assistant message just before them, make one assistant message),
    ``function_call_output`` items are ``tool`` messages answering an earlier call's ``call_id`` (any other id
    is a 400), ``reasoning`` items are dropped (the templates that reason drop past reasoning too); any other
    item type is a 400."""
    if isinstance(req.input, str):
        chat.add({"role": "user", "content": req.input}, "input", "input")
        return
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer; got {role!r}.",
                                  f"{where}.role")
            parts = _text_parts(item.get("content"), f"{where}.content")
            chat.add({"role": role, "content": parts}, where, f"{where}.content")
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) \
                    or not isinstance(arguments, str):
                raise bad_request(f"{where} needs call_id, name and arguments (a JSON string).", where)
            call = {"id": call_id, "type": "function", "function": {"name": _offered_name(item),
                                                                    "arguments": arguments}}
            if chat.open_calls:
                last = chat.messages[-1]
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                chat.add({"role": "assistant", "content": None, "tool_calls": [call]}, where, f"{where}.arguments")
            chat.calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in chat.calls:
                raise bad_request(f"{where}.call_id {call_id!r} answers no function_call earlier in input.",
                                  f"{where}.call_id")
            parts = _text_parts(item.get("output"), f"{where}.output")
            chat.add({"role": "tool", "tool_call_id": call_id, "content": parts}, where, f"{where}.output")
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise unsupported(f"{where}.type", "Items are not stored; send the item itself.")
        else:
            raise bad_request(f"{where} has an item type this server does not take: {kind!r} (it takes message, "
                              "function_call, function_call_output and reasoning).", f"{where}.type")


def _function(tool: dict[str, Any], name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if tool.get("parameters") is not None:
        function["parameters"] = tool["parameters"]
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tools(tools: list[dict[str, Any]] | None, names: dict[str, str]) -> tuple[list[dict[str, Any]],
                                                                              dict[str, tuple[str, str]]]:
    """``function`` tools as chat's function tools; a ``namespace``'s functions offered as
    ``<namespace>__<name>`` (and recorded, to name their calls back); ``web_search`` tools dropped (this server
    searches nothing); other tool types a 400."""
    out: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}

    def offer(tool: dict[str, Any], name: Any, source: str) -> None:
        k = len(out)
        out.append(_function(tool, name))
        for chat, ours in (("", ""), (".function.name", ".name"), (".function.parameters", ".parameters"),
                           (".function.description", ".description"), (".function.strict", ".strict")):
            names[f"tools[{k}]{chat}"] = f"{source}{ours}"

    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind == "function":
            offer(tool, tool.get("name"), where)
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list) or not isinstance(tool.get("name"), str):
                raise bad_request(f"{where} needs a name and a list of function tools.", where)
            for j, function in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(function, dict) or function.get("type") != "function":
                    raise bad_request(f"{at} must be a function tool.", f"{at}.type")
                offered = f"{tool['name']}{NAMESPACE_SEPARATOR}{function.get('name')}"
                if len(offered) > MAX_OFFERED_NAME:
                    raise bad_request(f"{at}.name: a namespace's functions are offered to the model as "
                                      f"<namespace>{NAMESPACE_SEPARATOR}<name>, at most {MAX_OFFERED_NAME} "
                                      f"characters; {offered!r} has {len(offered)}.", f"{at}.name")
                namespaced[offered] = (tool["name"], str(function.get("name")))
                offer(function, offered, at)
        elif kind in WEB_SEARCH_TYPES:
            continue  # nothing searches here: the model is not offered it
        else:
            raise bad_request(f"{where}.type {kind!r} is a tool this server does not run; it calls function tools "
                              "(and namespaces of them).", f"{where}.type")
    return out, namespaced


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}.",
                              "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {"name": fmt.get("name") or "output", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request("text.format must be text, json_object or {\"type\": \"json_schema\", \"name\", \"schema\"}.",
                      "text.format")


def _refuse_state(req: InputTokensRequest) -> None:
    """Refuses ``store: true``, ``previous_response_id``, ``conversation``, ``background: true``,
    ``truncation: "auto"``, ``top_logprobs`` above 0, ``max_tool_calls``, ``prompt`` and
    ``include: ["message.output_text.logprobs"]``: a stateless server without logprobs here cannot honour them."""
    stateless = "This server keeps no responses: send the whole conversation in input."
    if req.previous_response_id is not None:
        raise unsupported("previous_response_id", stateless)
    if req.conversation is not None:
        raise unsupported("conversation", stateless)
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", "Prompts are never truncated; shorten the input.")
    if not isinstance(req, ResponsesRequest):
        return
    if req.store:
        raise unsupported("store", f"{stateless} Set store to false.")
    if req.background:
        raise unsupported("background", "Responses run while the request is open.")
    if req.top_logprobs:
        raise unsupported("top_logprobs", "Logprobs are served by /v1/chat/completions.")
    if "message.output_text.logprobs" in (req.include or []):
        raise unsupported("include", "Logprobs are served by /v1/chat/completions.")
    if req.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "Use parallel_tool_calls: false for one call at most.")
    if req.prompt is not None:
        raise unsupported("prompt", "Prompt templates are kept by OpenAI's service; send instructions and input.")


def to_chat(req: InputTokensRequest, *, thinking_switch: bool = False) -> ResponsesTranslation:
    """``req`` as the chat request. ``instructions`` is the first, system message; ``tool_choice`` and
    ``parallel_tool_calls`` keep chat's meaning (``auto`` / ``none`` / ``parallel_tool_calls`` are dropped when
    no function is left to call); ``text.format`` is ``response_format``; ``max_output_tokens`` is
    ``max_tokens``; ``temperature``, ``top_p`` and ``stream`` keep their names; ``reasoning.effort: "none"``
    switches the template's ``enable_thinking`` off when ``thinking_switch`` says it has one."""
    _refuse_state(req)
    chat = _Conversation()
    if req.instructions:
        chat.add({"role": "system", "content": req.instructions}, "instructions", "instructions")
    _input(req, chat)
    names = dict(chat.names)
    tools, namespaced = _tools(req.tools, names)
    choice = _tool_choice(req.tool_choice)
    if not tools and choice in ("auto", "none"):
        choice = None  # nothing to call (web_search alone, or no tools): the same answer
    effort = (req.reasoning or {}).get("effort")
    fields: dict[str, Any] = {
        "model": req.model, "messages": chat.messages, "tools": tools or None, "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls if tools else None,
        "response_format": _response_format(req.text),
        "chat_template_kwargs": {"enable_thinking": False} if thinking_switch and effort == "none" else None,
    }
    if isinstance(req, ResponsesRequest):
        fields.update(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
                      stream=req.stream)
    names.update({"max_tokens": "max_output_tokens", "response_format.json_schema.schema": "text.format.schema",
                  "response_format": "text.format", "messages": "input", "chat_template_kwargs": "reasoning"})
    chat_fields = {k: v for k, v in fields.items() if v is not None}
    return ResponsesTranslation(Translated(chat_request(chat_fields), FieldNames(names)), namespaced)

