"""``/tokenize``, ``/detokenize`` and ``/version``: vLLM's utility endpoints.

Contract: ``router(server)`` (the core's ``ChatServer``) is a FastAPI ``APIRouter`` with
- ``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` or a chat
  (``{"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {...},
  "tools": [...]}``, rendered exactly as ``/v1/chat/completions`` renders it) ->
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
  ``return_token_strs``);
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (special
  tokens kept, ids checked against the vocabulary);
- ``GET /version``: ``{"version": stagemesh's version}``.
The model field, when given, must name the served model (404 otherwise); bad
input is a 400 in OpenAI's envelope, like every other route.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field

from gateway.chat.plan import ChatServer
from gateway.chat.request import (
    CHAT_TEMPLATE_KWARGS_SCHEMA,
    CHAT_TEMPLATE_SCHEMA,
    CONTINUE_FINAL_RULE,
    TOKEN_IDS,
    TOOLS_SCHEMA,
    ChatMessage,
    ChatRequest,
)
from gateway.chat.template import ChatOptions, chat_options, render_chat
from gateway.chat.tools import tool_plan
from gateway.http import errors
from gateway.http.schema import Strict, doc, request_rules
from stagemesh_core.settings import stagemesh_version


class TokenizeCompletionRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = doc(**CHAT_TEMPLATE_SCHEMA)
    chat_template_kwargs: dict[str, Any] | None = doc(**CHAT_TEMPLATE_KWARGS_SCHEMA)
    tools: list[dict[str, Any]] | None = doc(**TOOLS_SCHEMA)
    return_token_strs: bool = False

    model_config = ConfigDict(json_schema_extra=request_rules(CONTINUE_FINAL_RULE, runtime=(
        "chat-template-renders", "tool-names-distinct", "continue-final-message-after-assistant")))


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra=dict(TOKEN_IDS))


def router(server: ChatServer) -> APIRouter:
    routes = APIRouter()
    tokenizer, vocab = server.tokenizer, server.vocab_size

    def answer(ids: list[int], with_strs: bool) -> dict[str, Any]:
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids) if with_strs else None}

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict[str, Any]:
        server.check_model(body.model)
        if isinstance(body, TokenizeCompletionRequest):
            return answer(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens),
                          body.return_token_strs)
        chat = ChatRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     add_special_tokens=body.add_special_tokens, chat_template=body.chat_template,
                                     chat_template_kwargs=body.chat_template_kwargs, tools=body.tools)
        options: ChatOptions = chat_options(chat, server.defaults)
        return answer(list(render_chat(chat.messages, tokenizer, options, tool_plan(chat))), body.return_token_strs)

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        server.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.bad_request(f"Token id {bad} is out of the vocabulary (size {vocab}).", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False)}

    @routes.get("/version")
    async def version() -> dict[str, str]:
        return {"version": stagemesh_version()}

    return routes
