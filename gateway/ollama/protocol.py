"""Ollama's request bodies as the gateway takes them, and the options it knows.

Contract: ``ChatBody`` (``POST /api/chat``), ``GenerateBody`` (``POST /api/generate``) and ``ShowBody``
(``POST /api/show``) accept every top-level field Ollama's API defines (unknown ones are a 400 naming them, as
on the other APIs); a message keeps unknown keys out (clients send back the message they received). ``options``
is a plain dict here: ``gateway.ollama.translate`` reads it against ``APPLIED``, ``NEUTRAL_ONLY`` and
``IGNORED`` (every option Ollama defines) and refuses any other name. ``parse(raw, model)`` reads a body
whatever its Content-Type (Ollama's own docs send it with ``curl -d``), a 400 for one that is not JSON.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from gateway.http.errors import APIError, bad_request
from gateway.http.schema import Strict

M = TypeVar("M", bound=BaseModel)

# Options with a chat-request equivalent (docs/api.md, "Ollama API", has the table): Ollama's name -> the chat
# request's field; num_predict and num_ctx are read by gateway.ollama.translate itself.
APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens", "num_ctx": ""}
# Samplers the stages do not implement: accepted at the value that turns them off, refused otherwise.
NEUTRAL_ONLY: dict[str, float] = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
# Accepted and ignored: how llama.cpp loads and runs a model (threads, GPU layers, memory mapping, batch size),
# which the stages decide from `stagemesh serve`'s flags; Ollama's context shift (num_keep), which never happens
# here; repeat_last_n (the penalties cover the whole sequence, as vLLM's do); penalize_newline, which Ollama
# itself no longer applies; and mirostat's parameters, which matter only with mirostat on (refused).
IGNORED = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                     "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
                     "penalize_newline", "mirostat_tau", "mirostat_eta"})
KNOWN_OPTIONS = frozenset(APPLIED) | frozenset(NEUTRAL_ONLY) | IGNORED


class OllamaMessage(BaseModel):
    # Clients send back the message they were answered with, so keys beyond these are dropped, not refused.
    role: str
    content: str | None = None
    thinking: str | None = None  # past reasoning: dropped, as the templates that reason drop it
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    model_config = ConfigDict(extra="ignore")


class _Generation(Strict):
    """What /api/chat and /api/generate share."""

    model: str | None = None
    stream: bool | None = None  # None: streamed, Ollama's default
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None  # accepted: the model stays loaded while `stagemesh serve` runs
    think: bool | str | None = None
    truncate: bool | None = None  # accepted: a prompt is never truncated (one over the context is a 400)
    shift: bool | None = None  # accepted: the context never shifts (generation ends where the context does)
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ChatBody(_Generation):
    messages: list[OllamaMessage] = []  # none: Ollama's "load the model" call
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Generation):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None
    # Ollama's image-generation fields: refused (a language model).
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class ShowBody(Strict):
    model: str | None = None
    name: str | None = None  # the older name of ``model``
    verbose: bool | None = None


def _not_json(why: str) -> APIError:
    return bad_request(f"The request body is not valid JSON: {why}.", code="invalid_json")


def parse(raw: bytes, model: type[M]) -> M:
    """``raw`` as ``model``; an empty body is Ollama's "missing request body" (400). A ``ValidationError`` is
    raised as pydantic raises it: the route words it as every other body's (``gateway.http.errors``)."""
    if not raw.strip():
        raise bad_request("missing request body: send a JSON object.", code="invalid_json")
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as e:
        raise _not_json(str(e)) from None
    except json.JSONDecodeError as e:
        raise _not_json(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    return model.model_validate(value)
