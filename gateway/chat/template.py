"""Chat messages to prompt token ids through the model's own chat template.

Contract: ``render_chat(messages, tokenizer, options)`` checks the messages (roles, text-only content),
renders them with the chat template and its variables (``ChatOptions``), ending with the generation prompt or
leaving the final assistant message open (``continue_final_message``), and encodes the rendered text without
adding special tokens again unless ``add_special_tokens`` asks for them: the ids are exactly what the stage is
sent, so usage counts are exact. ``chat_options(req, defaults)`` builds the options and checks them. Any
problem is a 400 ``APIError`` whose ``param`` points at the field or message, never a 500.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from gateway.http.errors import bad_request

from .defaults import OpenAIDefaults
from .request import RESERVED_TEMPLATE_KWARGS, ChatMessage, ChatRequest
from .tools import ToolPlan, template_messages, template_supports_tools

_ROLES = ("system", "user", "assistant", "tool")


def _text_of(message: ChatMessage, where: str) -> str:
    content = message.content
    if message.tool_calls and message.role != "assistant":
        raise bad_request(f"{where}.tool_calls is only allowed on assistant messages.", f"{where}.tool_calls")
    for j, call in enumerate(message.tool_calls or []):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{j}] needs function.name and function.arguments.",
                              f"{where}.tool_calls")
    if content is None:
        if message.role == "assistant":
            return ""
        raise bad_request(f"{where}.content is required for role '{message.role}'.", f"{where}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}] has type {kind!r}; only text parts are supported.",
                              f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of system, developer, user, assistant, tool; "
                              f"got {message.role!r}.", f"{where}.role")
        out.append({"role": role, "content": _text_of(message, where)})
    return out


_RESERVED_KWARGS = frozenset(RESERVED_TEMPLATE_KWARGS)


@dataclass(frozen=True)
class ChatOptions:
    """How to render: ``template`` is the request's ``chat_template``, else the server's ``--chat-template``
    (None: the model's own); ``kwargs`` are ``--chat-template-kwargs`` overridden key by key by the request's
    ``chat_template_kwargs`` (e.g. ``enable_thinking``); ``add_generation_prompt`` is true unless the final
    message is continued; ``add_special_tokens`` adds them again when encoding (the template already wrote them).
    """

    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


def chat_options(req: ChatRequest, defaults: OpenAIDefaults) -> ChatOptions:
    kwargs = {**defaults.chat_template_kwargs, **(req.chat_template_kwargs or {})}
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs must not set {', '.join(reserved)}: use the request field of "
                          "that name.", "chat_template_kwargs")
    continue_final = bool(req.continue_final_message)
    add_generation = not continue_final if req.add_generation_prompt is None else req.add_generation_prompt
    if continue_final and add_generation:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true.",
                          "continue_final_message")
    if continue_final and req.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's.",
                          "continue_final_message")
    if req.chat_template is not None and not req.chat_template.strip():
        raise bad_request("chat_template must not be empty.", "chat_template")
    return ChatOptions(template=req.chat_template or defaults.chat_template, kwargs=kwargs,
                       add_generation_prompt=add_generation, continue_final_message=continue_final,
                       add_special_tokens=bool(req.add_special_tokens))


def render_chat(messages: Sequence[ChatMessage], tokenizer: Any, options: ChatOptions | None = None,
                tools: ToolPlan | None = None) -> tuple[int, ...]:
    o = options or ChatOptions()
    plan = tools or ToolPlan()
    template = o.template or getattr(tokenizer, "chat_template", None)
    native = template_supports_tools(template if isinstance(template, str) else None)
    conversation: list[dict[str, Any]] = list(normalize_messages(messages))
    conversation = template_messages(conversation, messages, plan, native)
    extra = dict(o.kwargs)
    if native and plan.active:
        extra["tools"] = [t.to_json() for t in plan.tools]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=o.add_generation_prompt,
            continue_final_message=o.continue_final_message, chat_template=o.template, **extra)
    except (TemplateError, ValueError, TypeError) as e:
        raise bad_request(f"The chat template could not render these messages: {e}", "messages") from e
    # Render, then encode: transformers 5 returns a BatchEncoding from ``apply_chat_template(tokenize=True)``;
    # text is the stable interface, and the encoded ids are exactly what the stage is sent.
    ids = tuple(tokenizer.encode(text, add_special_tokens=o.add_special_tokens))
    if not ids:
        raise bad_request("The rendered chat prompt is empty.", "messages")
    return ids
