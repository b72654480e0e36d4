"""Ollama's chat and generate requests as the core's requests: pure functions, no I/O.

Contract: ``chat_to_chat(body, facts)`` and ``generate_to_chat(body, facts)`` return an ``OllamaChat`` (the
``Translated`` chat request and the request's own ``num_ctx``); ``generate_raw(body, facts)`` returns a
``RawPrompt`` for ``raw: true`` (the prompt sent as written, no template: the core's completion path). Each
raises a 400 ``APIError`` naming the field in Ollama's terms: an unknown option, ``num_ctx`` above the served
context, images (a text-only model), ``suffix``, a Go ``template``, ``context``. ``served_name`` /
``check_model`` are Ollama's model names (``name:latest``), a 404 for another; ``within_num_ctx`` bounds a
plan's budget by ``num_ctx``; ``done_reason(stop)`` is Ollama's word for how a turn ended. Options map onto
the chat request's sampling fields (``protocol.APPLIED``); nothing samples, renders or parses here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pydantic import ValidationError

from gateway.chat.request import GenerationFields
from gateway.chat.sampling import SamplingSettings
from gateway.chat.translation import FieldNames, Translated, chat_request
from gateway.chat.turn import Stop
from gateway.http.errors import APIError, bad_request, unsupported

from .protocol import APPLIED, IGNORED, KNOWN_OPTIONS, NEUTRAL_ONLY, ChatBody, GenerateBody, OllamaMessage

_THINK_LEVELS = ("low", "medium", "high")  # gpt-oss's levels: each switches reasoning on (the level is not used)
_FORMAT_NAMES = {"response_format": "format", "response_format.json_schema.schema": "format"}
_DONE = {"end": "stop", "stop_string": "stop", "tool_calls": "stop", "length": "length", "context": "length"}


@dataclass(frozen=True)
class ServedFacts:
    """What a translation needs to know of the server: the model's name, its context, and its template's
    reasoning (``reasons``: it writes reasoning; ``switch``: ``enable_thinking`` turns it on and off)."""

    model: str
    max_model_len: int
    reasons: bool = False
    switch: bool = False


@dataclass(frozen=True)
class OllamaChat:
    translated: Translated
    num_ctx: int | None  # the request's own context, when below the served one


class RawFields(GenerationFields):
    """A raw prompt's generation fields: the completion path's, with Ollama's logprobs switch."""

    logprobs: bool | None = None
    top_logprobs: int | None = None

    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


@dataclass(frozen=True)
class RawPrompt:
    prompt: str
    fields: RawFields
    names: FieldNames
    num_ctx: int | None


def served_name(model: str) -> str:
    """The name Ollama's clients list and send back: Ollama gives every untagged name the tag ``latest``."""
    return model if ":" in model.rsplit("/", 1)[-1] else f"{model}:latest"


def check_model(name: str | None, model: str) -> str:
    """The name to answer with: the request's (as Ollama echoes it), the listed one when it sent none; a name
    that is neither the served model nor its listed name is Ollama's 404."""
    if not name:
        return served_name(model)
    if name in (model, served_name(model)):
        return name
    raise APIError(404, f'model "{name}" not found: this server serves "{served_name(model)}" only (the model '
                        "is chosen when `stagemesh serve` starts; nothing is pulled).", param="model",
                   code="model_not_found")


def done_reason(stop: Stop) -> str:
    """``stop`` (the end, a stop string, tool calls) or ``length`` (num_predict, or the end of the context)."""
    return _DONE[stop]


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise bad_request(f"options.{name} must be an integer, got {value!r}.", f"options.{name}")
    return int(value)


def _options(options: Mapping[str, Any] | None, max_model_len: int) -> tuple[dict[str, Any], int | None]:
    """The chat fields ``options`` sets and its ``num_ctx`` (None: the served context). ``num_predict`` below 1
    (Ollama's -1, its default, and -2) generates until the context is full: a budget of the whole context, which
    the core's ``fill_context`` makes the room left. Unset options take the server's defaults (the model's
    generation config), not Ollama's."""
    fields: dict[str, Any] = {}
    num_ctx: int | None = None
    for name, value in (options or {}).items():
        if name not in KNOWN_OPTIONS:
            raise bad_request(f"options.{name} is not an option this server knows (Ollama's options are listed in "
                              "docs/api.md, each applied, ignored or refused).", f"options.{name}",
                              code="unsupported_parameter")
        if value is None or name in IGNORED:
            continue
        if name in NEUTRAL_ONLY:
            if value != NEUTRAL_ONLY[name]:
                raise unsupported(f"options.{name}", f"The stages do not implement it; {NEUTRAL_ONLY[name]:g} "
                                  "(off) is accepted.")
            continue
        if name == "num_ctx":
            num_ctx = _integer(value, name)
            if not 1 <= num_ctx <= max_model_len:
                raise bad_request(f"options.num_ctx {num_ctx} must be between 1 and the served context of "
                                  f"{max_model_len} tokens (`stagemesh serve --max-model-len`).", "options.num_ctx")
            continue
        if name == "num_predict":
            predict = _integer(value, name)
            fields["max_tokens"] = predict if predict > 0 else max_model_len
            continue
        if name == "seed" and value == -1:
            continue  # Ollama's -1: a random seed, as none
        fields[APPLIED[name]] = value
    return fields, (num_ctx if num_ctx is not None and num_ctx < max_model_len else None)


def _option_names() -> dict[str, str]:
    return {chat: f"options.{name}" for name, chat in APPLIED.items() if chat}


def _response_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """``"json"``: any JSON object; a JSON Schema object: that schema; ``""`` or none: free text."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON Schema object, got {fmt!r}.', "format")


def _raw_format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    rf = _response_format(fmt)
    if rf is None:
        return None
    return {"json": {"type": "object"} if rf["type"] == "json_object" else rf["json_schema"]["schema"]}


def _think(think: bool | str | None, facts: ServedFacts) -> dict[str, Any] | None:
    """``think`` as the template's ``enable_thinking`` where it has the switch; true for a model whose template
    does not reason is Ollama's 400. A template that reasons without a switch reasons whatever ``think`` says."""
    if think is None:
        return None
    if isinstance(think, str) and think not in _THINK_LEVELS:
        raise bad_request(f"think must be true, false or one of {', '.join(_THINK_LEVELS)}; got {think!r}.", "think")
    on = think is not False
    if on and not facts.reasons:
        raise bad_request(f'"{served_name(facts.model)}" does not support thinking: its chat template writes no '
                          "reasoning.", "think")
    return {"enable_thinking": on} if facts.switch else None


def _no_images(images: list[Any] | None, where: str) -> None:
    if images:
        raise bad_request(f"{where}: this server serves a text-only model; send the message without images.",
                          where, code="unsupported_parameter")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{\"function\": {{\"name\": ..., \"arguments\": {{...}}}}}}.", where)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):  # some clients send OpenAI's string form back
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be an object.", f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": json.dumps(arguments)}}
    return {"id": call["id"], **out} if isinstance(call.get("id"), str) and call["id"] else out


def _message(message: OllamaMessage, where: str) -> dict[str, Any]:
    """A chat message: ``content`` (empty when left out), an assistant's ``tool_calls`` with their arguments
    as JSON text, a tool result's ``tool_name`` as its ``name``; ``images`` are refused, ``thinking`` dropped."""
    _no_images(message.images, f"{where}.images")
    out: dict[str, Any] = {"role": message.role, "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message.tool_calls)]
    if message.tool_name is not None:
        out["name"] = message.tool_name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _common(body: ChatBody | GenerateBody, facts: ServedFacts) -> tuple[dict[str, Any], int | None]:
    """The fields chat and generate share, the options first."""
    fields, num_ctx = _options(body.options, facts.max_model_len)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
    fields.update(stream=body.stream is not False, logprobs=body.logprobs, top_logprobs=body.top_logprobs)
    return fields, num_ctx


def _built(fields: dict[str, Any], names: FieldNames) -> Translated:
    try:
        chat = chat_request({k: v for k, v in fields.items() if v is not None})
    except APIError as e:
        raise names.renamed(e) from None
    return Translated(chat, names)


def chat_to_chat(body: ChatBody, facts: ServedFacts) -> OllamaChat:
    """``messages`` keep their order and indices (a final assistant text is continued, as Ollama's templates
    leave it open); ``tools`` are chat's function tools (Ollama's are the same shape), offered with
    ``tool_choice`` auto; ``format`` is ``response_format``; ``think`` the template's switch. A body with no
    messages is the load call (``serving`` answers it before any translation)."""
    fields, num_ctx = _common(body, facts)
    # Ollama's tools are function tools whether or not they say so ("type" defaults to "function" there).
    tools = None if body.tools is None else [t if "type" in t else {"type": "function", **t} for t in body.tools]
    fields.update(messages=[_message(m, f"messages[{i}]") for i, m in enumerate(body.messages)], tools=tools,
                  response_format=_response_format(body.format), chat_template_kwargs=_think(body.think, facts))
    names = {**_option_names(), **_FORMAT_NAMES, "chat_template_kwargs": "think"}
    last = body.messages[-1] if body.messages else None
    if last is not None and last.role == "assistant" and last.content and not last.tool_calls:
        # Ollama's templates leave a final assistant message open: the model continues its text.
        fields.update(continue_final_message=True, add_generation_prompt=False)
        names["continue_final_message"] = f"messages[{len(body.messages) - 1}]"
    return OllamaChat(_built(fields, FieldNames(names)), num_ctx)


def _refuse_generate_extras(body: GenerateBody) -> None:
    _no_images(body.images, "images")
    if body.suffix:
        raise unsupported("suffix", "Fill-in-the-middle is not implemented; send the text before the gap as prompt.")
    if body.context:
        raise unsupported("context", "It is deprecated in Ollama too; send the conversation as messages to "
                                     "/api/chat (replies carry no context).")
    if body.template:
        raise unsupported("template", "Ollama's Go templates are not rendered here: the model's own chat template "
                                      "is used, or send raw: true with the prompt already formatted.")
    for name in ("width", "height", "steps"):
        if getattr(body, name) is not None:
            raise unsupported(name, "It is for image-generation models; this server serves a language model.")


def generate_to_chat(body: GenerateBody, facts: ServedFacts) -> OllamaChat:
    """The prompt as a user message after ``system`` (when given), rendered with the chat template."""
    _refuse_generate_extras(body)
    fields, num_ctx = _common(body, facts)
    messages = ([{"role": "system", "content": body.system}] if body.system else [])
    messages.append({"role": "user", "content": body.prompt or ""})
    fields.update(messages=messages, response_format=_response_format(body.format),
                  chat_template_kwargs=_think(body.think, facts))
    names = {**_option_names(), **_FORMAT_NAMES, "chat_template_kwargs": "think", "messages": "prompt",
             f"messages[{len(messages) - 1}]": "prompt"}
    if body.system:
        names["messages[0]"] = "system"
    return OllamaChat(_built(fields, FieldNames(names)), num_ctx)


def generate_raw(body: GenerateBody, facts: ServedFacts) -> RawPrompt:
    """``raw: true``: the prompt is sent as written (encoded as the completions endpoint encodes it), so
    ``system`` and ``think``, which need the template, are refused with it."""
    _refuse_generate_extras(body)
    for name in ("system", "think"):
        if getattr(body, name) not in (None, ""):
            raise bad_request(f"{name} needs the chat template, which raw: true leaves out; format the prompt "
                              "yourself, or drop raw.", name)
    fields, num_ctx = _common(body, facts)
    fields["structured_outputs"] = _raw_format(body.format)
    names = FieldNames({**_option_names(), "structured_outputs": "format", "structured_outputs.json": "format"})
    try:
        raw = RawFields.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:  # a type the field cannot hold: named as chat_request names it
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise names.renamed(bad_request(f"{where}: {first.get('msg')}", where or None)) from None
    return RawPrompt(body.prompt or "", raw, names, num_ctx)


def within_num_ctx(settings: SamplingSettings, prompt_len: int, num_ctx: int | None) -> SamplingSettings:
    """``settings`` with its budget bounded by the request's own context: the prompt and the generation fit in
    ``num_ctx`` tokens (a prompt that fills it is a 400 naming both numbers); unchanged without one."""
    if num_ctx is None:
        return settings
    room = num_ctx - prompt_len
    if room < 1:
        raise bad_request(f"The prompt holds {prompt_len} tokens, which leaves no room in options.num_ctx "
                          f"{num_ctx}; raise num_ctx or shorten the prompt.", "options.num_ctx",
                          code="context_length_exceeded")
    asked = settings.max_tokens
    return replace(settings, max_tokens=room if asked is None else min(asked, room))
