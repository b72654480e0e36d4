"""The plan of a chat request: every check and the rendered prompt, in one pass, before anything is sent.

Contract:
- ``ChatServer.create(model, max_model_len, tokenizer, eos_token_ids, defaults)`` is what the server brings to
  every request: the served model and its context, the tokenizer, EOS, the chat defaults
  (``gateway.chat.defaults``), the chat template and the tool-call format it picks. ``check_model(model)``
  is the served name, or a 404 for another.
- ``plan_chat(req, server, arrived)`` reads a ``ChatRequest`` once: the model, the sampling settings (with the
  request's output constraint: ``gateway.chat.sampling``), the tools and a forced call's grammar, the chat
  template's options and the rendered prompt. It returns a frozen ``ChatPlan`` or raises the first check's
  ``APIError``, naming the field; nothing is sent. ``ChatPlan.reading`` (a ``Reading``) is how its reply
  reads back (``gateway.chat.turn``). The token budget is checked when the plan runs (``gateway.chat.core``),
  so a plan also counts a prompt's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.http import errors
from gateway.parsing.reasoning import opens_reasoning, template_reasons
from gateway.parsing.tool_parsers import PARSERS, ToolFormat, pick_parser

from .defaults import OpenAIDefaults
from .grammar import json_schema_grammar
from .request import ChatRequest
from .sampling import SamplingSettings, settings_from_request
from .template import chat_options, render_chat
from .tools import ToolPlan, tool_plan

_PROMPT_TAIL_TOKENS = 8  # enough to hold a template's opening <think> and the newline after it


@dataclass(frozen=True, eq=False)
class ChatServer:
    model: str
    max_model_len: int
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    defaults: OpenAIDefaults
    chat_template: str | None  # the server's: --chat-template, else the model's own
    tool_format: ToolFormat
    thinking_switch: bool  # the chat template turns its reasoning on and off with ``enable_thinking``

    @staticmethod
    def create(model: str, max_model_len: int, tokenizer: Any, eos_token_ids: frozenset[int],
               defaults: OpenAIDefaults) -> ChatServer:
        """``len()`` of a Hugging Face tokenizer walks its added tokens on every call, which is slow for a
        vocabulary with many added tokens: it is taken once here, not per request on the event loop
        (docs/performance.md has the figures). An unknown ``tool_call_parser`` is a ``ValueError``."""
        template = defaults.chat_template or getattr(tokenizer, "chat_template", None)
        chat_template = template if isinstance(template, str) else None
        return ChatServer(model, max_model_len, tokenizer, len(tokenizer), frozenset(eos_token_ids), defaults,
                          chat_template, PARSERS[pick_parser(defaults.tool_call_parser, chat_template)],
                          "enable_thinking" in (chat_template or ""))

    def check_model(self, model: str | None) -> str:
        if model and model != self.model:
            raise errors.model_not_found(model, self.model)
        return self.model


@dataclass(frozen=True)
class Reading:
    """How a reply reads back (``gateway.chat.turn``); the default reads plain text: no tools (so no format is
    consulted), no reasoning."""

    tools: ToolPlan = field(default_factory=ToolPlan)
    tool_format: ToolFormat = PARSERS["hermes"]
    reasons: bool = False  # the chat template writes reasoning
    inside: bool = False  # the rendered prompt opened it: the reply begins as reasoning


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked and rendered: what goes to the mesh (nothing was sent yet)."""

    model: str
    settings: SamplingSettings
    prompt: tuple[int, ...]
    reading: Reading
    arrived: float  # time.monotonic() when the request arrived

    @property
    def tools(self) -> ToolPlan:
        return self.reading.tools


def _with_forced_call(settings: SamplingSettings, tools: ToolPlan, strict: bool) -> SamplingSettings:
    """A forced ``tool_choice`` constrains the output to the call (its JSON Schema as the grammar); it cannot be
    combined with the request's own output constraint."""
    forced = tools.forced_schema()
    if forced is None:
        return settings
    if settings.sampling.grammar:
        raise errors.bad_request(f"tool_choice {tools.mode} constrains the output already; it cannot be "
                                 "combined with response_format or guided_*.", "tool_choice")
    return settings.with_grammar(json_schema_grammar(forced, "tools", strict))


def _reading(prompt: tuple[int, ...], tools: ToolPlan, server: ChatServer) -> Reading:
    """The server's template writes reasoning, and the rendered prompt may itself open it (``opens_reasoning``)."""
    reasons = template_reasons(server.chat_template)
    tail = server.tokenizer.decode(list(prompt[-_PROMPT_TAIL_TOKENS:])) if reasons else ""
    return Reading(tools, server.tool_format, reasons, reasons and opens_reasoning(tail))


def plan_chat(req: ChatRequest, server: ChatServer, arrived: float) -> ChatPlan:
    """The checks in the order a client meets them: the model (404), the sampling fields, the tools, a forced
    call against the output constraint, the template's options, then the render."""
    model = server.check_model(req.model)
    strict = server.defaults.structured_output_strict
    settings = settings_from_request(req, server.defaults.generation, server.vocab_size, strict)
    tools = tool_plan(req)
    settings = _with_forced_call(settings, tools, strict or tools.strict)
    prompt = render_chat(req.messages, server.tokenizer, chat_options(req, server.defaults), tools)
    return ChatPlan(model, settings, prompt, _reading(prompt, tools, server), arrived)
