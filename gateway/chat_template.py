"""Chat messages to prompt token ids through the model's own chat template.

Contract: ``render_chat(messages, tokenizer)`` checks the messages (roles,
text-only content), renders them with the tokenizer's chat template and
``add_generation_prompt=True``, and encodes the rendered text without adding
special tokens again (the template already wrote them). Any problem is a 400
``APIError`` whose ``param`` points at the message, never a 500.

Why render-then-encode: transformers 5 returns a BatchEncoding from
``apply_chat_template(tokenize=True)``; text is the stable interface, and the
encoded ids are exactly what the stage is sent (so usage counts are exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from .errors import bad_request, unsupported
from .schemas import ChatMessage

_ROLES = ("system", "user", "assistant", "tool")


def _text_of(message: ChatMessage, where: str) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant" and not message.tool_calls:
            return ""
        if message.tool_calls:
            raise unsupported(f"{where}.tool_calls", "Tool calling is not implemented.")
        raise bad_request(f"{where}.content is required for role '{message.role}'.", f"{where}.content")
    if message.tool_calls:
        raise unsupported(f"{where}.tool_calls", "Tool calling is not implemented.")
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


def render_chat(messages: Sequence[ChatMessage], tokenizer: Any) -> tuple[int, ...]:
    conversation = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError) as e:
        raise bad_request(f"The chat template could not render these messages: {e}", "messages") from e
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise bad_request("The rendered chat prompt is empty.", "messages")
    return ids
