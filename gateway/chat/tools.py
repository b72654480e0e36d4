"""A chat request's tools: what the model is told, what it may or must call, and how calls come back.

Contract:
- ``tool_plan(req)`` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (a 400 naming the field)
  and returns a frozen ``ToolPlan`` whose ``mode`` is ``none`` (tools ignored, not shown to the model),
  ``auto`` (the model may call; its text is parsed with the server's tool-call parser), ``required`` or
  ``named``.
- ``ToolPlan.forced_schema()``: for ``required`` and ``named`` the JSON Schema the output is constrained to
  (``gateway.chat.grammar`` compiles it), so the call and its arguments are valid even from a small
  model; ``ToolPlan.forced_calls(text)`` turns that output back into ``ToolCall``s.
- ``template_messages(conversation, messages, plan, native)`` are the messages as the chat template gets them,
  with their tool calls and results; a template that does not know tools (``template_supports_tools``) gets
  them written in the Hermes format, which the ``hermes`` parser reads back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.http.errors import bad_request
from gateway.parsing.tool_parsers import FORCED, ToolCall, new_call_id

from .request import TOOL_NAME_PATTERN, ChatMessage, ChatRequest

Mode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(TOOL_NAME_PATTERN)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False  # the request's function.strict (the server's switch applies either way)

    def to_json(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...] = ()
    mode: Mode = "none"
    name: str | None = None  # the function of a named tool_choice
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def strict(self) -> bool:
        """A tool the output is forced to asked for ``strict``: honoured under a lax server too."""
        forced = [t for t in self.tools if self.mode == "required" or t.name == self.name]
        return any(t.strict for t in forced)

    def forced_schema(self) -> dict[str, Any] | None:
        """``named``: the function's arguments object; ``required``: a JSON array of ``{"name", "parameters"}``
        objects (one item unless ``parallel``), vLLM's shape, read back as the ``FORCED`` format of
        ``gateway.parsing.tool_parsers`` (which a stream reads incrementally too); None otherwise."""
        if self.mode == "named":
            return next(t.parameters for t in self.tools if t.name == self.name)
        if self.mode != "required":
            return None
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": t.name}, "parameters": t.parameters}} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def forced_calls(self, text: str) -> list[ToolCall]:
        """The calls a forced (constrained) output holds; [] if it was cut short (finish "length").

        The arguments are the model's JSON text as generated, as a stream sends them."""
        if self.mode == "named" and self.name is not None:
            try:
                whole = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                whole = False
            return [ToolCall(self.name, text, new_call_id())] if whole else []
        return FORCED.parse(text)[1]


def _tool(raw: dict[str, Any], i: int) -> Tool:
    where = f"tools[{i}]"
    if raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}.", where)
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -; got {name!r}.",
                          f"{where}.function.name")
    parameters = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object.", f"{where}.function.parameters")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string.", f"{where}.function.description")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict must be a boolean.", f"{where}.function.strict")
    return Tool(name, description, parameters, bool(strict))


def tool_plan(req: ChatRequest) -> ToolPlan:
    """A 400 for ``tool_choice`` or ``parallel_tool_calls`` without ``tools`` (as OpenAI and vLLM), an unknown
    function, duplicate names, or a malformed tool."""
    tools = tuple(_tool(t, i) for i, t in enumerate(req.tools or []))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names.", "tools")
    choice = req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if choice is not None and not tools:
        raise bad_request("tool_choice is only allowed when tools are given.", "tool_choice")
    if req.parallel_tool_calls is not None and not tools:
        raise bad_request("parallel_tool_calls is only allowed when tools are given.", "parallel_tool_calls")
    if not tools or choice == "none":
        return ToolPlan(tools, "none", parallel=parallel)
    if choice is None or choice == "auto":
        return ToolPlan(tools, "auto", parallel=parallel)
    if choice == "required":
        return ToolPlan(tools, "required", parallel=parallel)
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)}).",
                              "tool_choice")
        return ToolPlan(tools, "named", name=name, parallel=parallel)
    raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}.", "tool_choice")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _hermes_system(tools: Sequence[Tool]) -> str:
    listed = "\n".join(json.dumps(t.to_json(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def template_messages(conversation: list[dict[str, Any]], messages: Sequence[ChatMessage], plan: ToolPlan,
                      native: bool) -> list[dict[str, Any]]:
    """``conversation`` (role/content dicts from the messages) with tool calls and results added.

    A ``native`` template gets assistant ``tool_calls`` with their arguments as objects (the Hugging Face
    convention) and ``tool`` messages with their ``tool_call_id``. Any other gets the tools described in the
    system message in the Hermes format, with past calls and results written as ``<tool_call>`` /
    ``<tool_response>`` text.
    """
    out: list[dict[str, Any]] = []
    for item, message in zip(conversation, messages, strict=True):
        item = dict(item)
        calls = [c.get("function", {}) for c in message.tool_calls or []]
        if native:
            if calls:
                item["tool_calls"] = [{"type": "function", "function": {"name": c.get("name"),
                                                                        "arguments": _arguments(c.get("arguments"))}}
                                      for c in calls]
            if message.role == "tool" and message.tool_call_id:
                item["tool_call_id"] = message.tool_call_id
        else:
            if calls:
                written = "\n".join("<tool_call>\n" + json.dumps({"name": c.get("name"),
                                                                  "arguments": _arguments(c.get("arguments"))},
                                                                 ensure_ascii=False) + "\n</tool_call>"
                                    for c in calls)
                item["content"] = (item["content"] + "\n" if item["content"] else "") + written
            if message.role == "tool":
                item["content"] = f"<tool_response>\n{item['content']}\n</tool_response>"
        out.append(item)
    if plan.active and not native:
        system = _hermes_system(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
