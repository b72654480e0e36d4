"""A Messages API request as the core's chat request: one pure function, no I/O.

Contract: ``to_chat(req, thinking_switch=...)`` returns a ``Translated`` (the ``ChatRequest`` and
the way back to this API's field names) or raises a 400 ``APIError`` naming the block or field. ``system``
and the messages become chat messages (``tool_use`` / ``tool_result`` blocks are ``tool_calls`` and ``tool``
messages; a final assistant text is prefilled), ``tools`` and ``tool_choice`` become chat's function tools,
and the sampling fields keep their meaning. What a text-only chat server cannot take (images, documents,
Anthropic's server tools, ``mcp_servers``, ``container``) is refused, never dropped silently; ``thinking``
blocks are dropped, as the templates that reason drop past reasoning.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.chat.translation import FieldNames, Translated, chat_request
from gateway.http.errors import APIError, bad_request, unsupported

from .protocol import CountTokensRequest, MessagesRequest

_MEDIA = ("image", "document", "search_result", "container_upload")
_ASSISTANT_ONLY = ("tool_use", "thinking", "redacted_thinking")
_DROPPED = ("thinking", "redacted_thinking")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _kind(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"{where} must be a content block: an object with a 'type'.", where)
    if kind in _MEDIA:
        raise bad_request(f"{where}.type: {kind} blocks are not supported; this server serves a text-only model "
                          "(content blocks are text, tool_use, tool_result, thinking, redacted_thinking).",
                          f"{where}.type")
    return kind


def _unknown(kind: str, where: str) -> APIError:
    return bad_request(f"{where}.type {kind!r} is not a content block this server takes (text, tool_use, "
                       "tool_result, thinking, redacted_thinking).", f"{where}.type")


def _text(block: dict[str, Any], where: str) -> dict[str, str]:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string.", f"{where}.text")
    return {"type": "text", "text": text}


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, str]]:
    if system is None or isinstance(system, str):
        return [{"type": "text", "text": system}] if system else []
    return _text_blocks(system, "system")


def _text_blocks(blocks: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
    """A list that may hold only text blocks (a system prompt, a tool result's content), each checked."""
    parts = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if _kind(block, at) != "text":
            raise bad_request(f"{at} must be a text block.", f"{at}.type")
        parts.append(_text(block, at))
    return parts


def _tool_result(block: dict[str, Any], where: str, answerable: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in answerable:
        known = ", ".join(sorted(answerable)) or "none"
        raise bad_request(f"{where}.tool_use_id {call_id!r} answers no tool_use of the assistant message just "
                          f"before it (its tool_use ids: {known}).", f"{where}.tool_use_id")
    content = block.get("content")
    if content is None or isinstance(content, str):
        parts = [{"type": "text", "text": content or ""}]
    elif isinstance(content, list):
        parts = _text_blocks(content, f"{where}.content")
    else:
        raise bad_request(f"{where}.content must be a string or a list of text blocks.", f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": parts}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
        raise bad_request(f"{where} needs a string id and name.", where)
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input must be an object.", f"{where}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


class _Conversation:
    """The chat messages being built, and where each came from."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}

    def add(self, message: dict[str, Any], source: str, content_source: str) -> None:
        k = len(self.messages)
        self.messages.append(message)
        self.names[f"messages[{k}]"] = source
        self.names[f"messages[{k}].content"] = content_source


def _messages(req: CountTokensRequest, chat: _Conversation) -> bool:
    """Adds the conversation; True when its last message is an assistant's text to continue (a prefill).

    A ``system`` message (text) is a system message where it stands. A user message's text blocks are its
    content; each ``tool_result`` is a ``tool`` message answering a ``tool_use`` of the assistant message just
    before (any other id is a 400). An assistant message's text blocks are its content and its ``tool_use``
    blocks its ``tool_calls``; ``thinking`` and ``redacted_thinking`` blocks are dropped. Images, documents and
    any other block type are a 400. A conversation ending with the assistant's text (and no tool_use) is
    prefilled: the model continues that text (``continue_final_message``).
    """
    answerable: set[str] = set()
    prefill = False
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        last = i == len(req.messages) - 1
        if message.role == "system":
            parts = []
            for j, block in enumerate(blocks):
                at = f"{where}.content[{j}]"
                if _kind(block, at) != "text":
                    raise bad_request(f"{at}.type: a system message holds text blocks.", f"{at}.type")
                parts.append(_text(block, at))
            chat.add({"role": "system", "content": parts}, where, f"{where}.content")
            continue  # instructions between turns: the calls before still await their results
        if message.role == "user":
            texts: list[dict[str, str]] = []
            added = False
            for j, block in enumerate(blocks):
                at = f"{where}.content[{j}]"
                kind = _kind(block, at)
                if kind == "text":
                    texts.append(_text(block, at))
                elif kind == "tool_result":
                    if texts:
                        chat.add({"role": "user", "content": texts}, where, f"{where}.content")
                        texts = []
                    chat.add(_tool_result(block, at, answerable), at, f"{at}.content")
                    added = True
                elif kind in _ASSISTANT_ONLY:
                    raise bad_request(f"{at}.type: a {kind} block belongs to an assistant message.", f"{at}.type")
                else:
                    raise _unknown(kind, at)
            if texts or not added:
                chat.add({"role": "user", "content": texts}, where, f"{where}.content")
            answerable = set()
            continue
        texts, calls = [], []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = _kind(block, at)
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_use":
                calls.append(_tool_call(block, at))
            elif kind == "tool_result":
                raise bad_request(f"{at}.type: a tool_result block belongs to a user message.", f"{at}.type")
            elif kind not in _DROPPED:
                raise _unknown(kind, at)
        answerable = {c["id"] for c in calls}
        # Only text is continued; an assistant message with calls (or nothing to continue) is history before
        # a new turn.
        prefill = last and not calls and bool("".join(t["text"] for t in texts))
        chat.add({"role": "assistant", "content": texts or None, "tool_calls": calls or None}, where,
                 f"{where}.content")
    return prefill


def _tools(req: CountTokensRequest, names: dict[str, str]) -> list[dict[str, Any]] | None:
    """``tools`` (``name``, ``description``, ``input_schema``) as function tools; Anthropic's own server tools
    (a ``type`` other than ``custom``) are a 400."""
    if req.tools is None:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"{where}.type {kind!r} is one of Anthropic's own tools, which this server does not "
                              "run; describe it as a custom tool (name, description, input_schema).", f"{where}.type")
        if "input_schema" not in tool:
            raise bad_request(f"{where}.input_schema is required: the JSON Schema of the tool's input.",
                              f"{where}.input_schema")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
        for chat, ours in (("", ""), (".function.name", ".name"), (".function.parameters", ".input_schema"),
                           (".function.description", ".description"), (".function.strict", ".strict")):
            names[f"tools[{i}]{chat}"] = f"{where}{ours}"
    return tools


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """``auto`` / ``any`` / ``tool`` / ``none`` as chat's ``auto`` / ``required`` / a named function / ``none``,
    and ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in _TOOL_CHOICES:
        return _TOOL_CHOICES[kind], (None if kind == "none" else parallel)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name must name one of the tools.", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}.", "tool_choice.type")


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                          "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(thinking: dict[str, Any] | None, switch: bool) -> dict[str, Any] | None:
    """``thinking`` as the template's ``enable_thinking`` (disabled: false; otherwise true), only when
    ``switch`` says the template has one; its budget is not used."""
    if thinking is None or not switch:
        return None
    return {"enable_thinking": thinking.get("type") != "disabled"}


def to_chat(req: CountTokensRequest, *, thinking_switch: bool = False) -> Translated:
    """``req`` as the chat request. ``system`` (a string or text blocks) is the first, system message;
    ``output_config.format`` (``json_schema``) is ``response_format``; ``stop_sequences`` is ``stop``;
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``stream`` keep their names; every field
    docs/api.md lists as ignored is not used; ``mcp_servers`` and ``container`` are refused."""
    if req.mcp_servers:
        raise unsupported("mcp_servers", "The gateway connects to no MCP server; give the tools as tools.")
    chat = _Conversation()
    system = _system(req.system)
    if system:
        chat.add({"role": "system", "content": system}, "system", "system")
    prefill = _messages(req, chat)
    names = dict(chat.names)
    tools = _tools(req, names)
    tool_choice, parallel = _tool_choice(req.tool_choice)
    fields: dict[str, Any] = {
        "model": req.model, "messages": chat.messages, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "response_format": _response_format(req.output_config),
        "chat_template_kwargs": _thinking(req.thinking, thinking_switch),
    }
    if prefill:
        fields.update(continue_final_message=True, add_generation_prompt=False)
        names["continue_final_message"] = f"messages[{len(req.messages) - 1}]"
    if isinstance(req, MessagesRequest):
        if req.container is not None:
            raise unsupported("container", "Containers belong to Anthropic's code-execution tools.")
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    names.update({"stop": "stop_sequences", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                  "response_format.json_schema.schema": "output_config.format.schema",
                  "response_format": "output_config.format", "chat_template_kwargs": "thinking"})
    return Translated(chat_request({k: v for k, v in fields.items() if v is not None}), FieldNames(names))
