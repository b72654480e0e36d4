"""Another API's request as the core's chat request, and its errors back in that API's terms.

Contract:
- ``chat_request(fields)`` builds the ``ChatRequest`` a translated request becomes (each API's
  ``translate`` module); everything it asks of the mesh then goes through the core's one plan and run
  (``gateway.chat.core``): one path for every API.
- ``FieldNames`` maps the chat request's field paths to the client's own; ``renamed(err)`` is the core
  check's ``APIError`` naming the client's field, in ``param`` and in the message; ``Translated.named(step)``
  runs a step of the core with its errors so renamed.
- ``chat_field_schema(name)`` is the documented JSON Schema of a chat field (its range and limits), so the
  other APIs' schemas state the same bounds the chat checks enforce, from one definition.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from gateway.http.errors import APIError, bad_request

from .request import ChatRequest

T = TypeVar("T")


def chat_request(fields: Mapping[str, Any]) -> ChatRequest:
    try:
        return ChatRequest.model_validate(dict(fields))
    except ValidationError as e:  # the translation's own output: a field the chat request cannot hold
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", where or None) from None


def chat_field_schema(name: str) -> dict[str, Any]:
    extra = ChatRequest.model_fields[name].json_schema_extra
    return copy.deepcopy(extra) if isinstance(extra, dict) else {}


@dataclass(frozen=True)
class FieldNames:
    """Chat field paths (``messages[3].content``, ``stop``, ``tools[0].function.parameters``) to the client's
    own (``messages[1].content[2].content``, ``stop_sequences``, ``tools[0].input_schema``): the longest mapped
    prefix of a path is replaced. ``renamed`` replaces the chat field where the message names it, and otherwise
    puts the client's field first."""

    renames: Mapping[str, str] = field(default_factory=dict)

    def client_param(self, param: str | None) -> str | None:
        if param is None:
            return None
        for chat in sorted(self.renames, key=len, reverse=True):
            if param == chat or param.startswith((chat + ".", chat + "[")):
                return self.renames[chat] + param[len(chat):]
        return param

    def renamed(self, err: APIError) -> APIError:
        param = self.client_param(err.param)
        if param == err.param or err.param is None or param is None:
            return err
        # The chat field as a whole name in the message (not inside a longer name such as stop_token_ids).
        named = re.compile(r"(?<![\w.\[\]])" + re.escape(err.param) + r"(?![\w\[])")
        message = named.sub(param, err.message) if named.search(err.message) else f"{param}: {err.message}"
        return APIError(err.status, message, param=param, code=err.code, should_retry=err.should_retry)


@dataclass(frozen=True)
class Translated:
    """A request in the core's chat terms, and how to name its fields back."""

    chat: ChatRequest
    names: FieldNames = field(default_factory=FieldNames)

    def named(self, step: Callable[[], T]) -> T:
        try:
            return step()
        except APIError as e:
            raise self.names.renamed(e) from None
