"""Server-side defaults of every chat request: the model's generation config, the chat template, tool calls.

Contract:
- ``OpenAIDefaults`` (named for the flags it mirrors) is one frozen value the core reads (``GatewayConfig.openai``):
  ``generation`` (the sampling defaults for fields a request leaves unset, vLLM's
  ``--generation-config``), ``chat_template`` (replaces the model's own; a request's
  ``chat_template`` replaces both) and ``chat_template_kwargs`` (variables every chat render
  gets; a request's ``chat_template_kwargs`` override them key by key), ``tool_call_parser``
  (the format of the model's tool calls, ``--tool-call-parser``; None: from the chat template) and
  ``structured_output_strict`` (``--[no-]structured-output-strict``: JSON Schemas enforced strictly).
- ``generation_defaults_from_file(path)`` reads a ``generation_config.json``: only the fields
  vLLM takes from it (``temperature``, ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty``, ``max_new_tokens``), and only when ``do_sample`` does not turn
  sampling off; raises ``ValueError`` naming the file for one that is not a JSON object.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults for request fields left unset; None: OpenAI's own default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def describe(self) -> str:
        set_ = {k: v for k, v in self.__dict__.items() if v is not None}
        return ", ".join(f"{k}={v}" for k, v in set_.items()) or "none"


@dataclass(frozen=True)
class OpenAIDefaults:
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None  # None: picked from the chat template (gateway.parsing.tool_parsers)
    # --structured-output-strict (the default): JSON Schemas close their objects (gateway.chat.grammar).
    structured_output_strict: bool = True


def generation_defaults_from_file(path: str) -> GenerationDefaults:
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return generation_defaults_from_dict(raw)


def generation_defaults_from_dict(raw: Mapping[str, Any]) -> GenerationDefaults:
    def number(name: str) -> float | None:
        value = raw.get(name)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    top_k = raw.get("top_k")
    max_new = raw.get("max_new_tokens")
    sampling = raw.get("do_sample", True) is not False
    return GenerationDefaults(
        # With do_sample false the model's authors want greedy decoding, whatever else the file says.
        temperature=number("temperature") if sampling else 0.0,
        top_p=number("top_p") if sampling else None,
        top_k=int(top_k) if sampling and isinstance(top_k, int) and not isinstance(top_k, bool) else None,
        min_p=number("min_p") if sampling else None,
        repetition_penalty=number("repetition_penalty"),
        max_tokens=int(max_new) if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0
        else None,
    )


def model_generation_defaults(model_path: str) -> GenerationDefaults:
    """The model directory's ``generation_config.json`` (none for a GGUF file or a directory without it)."""
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if not os.path.isdir(model_path) or not os.path.exists(path):
        return GenerationDefaults()
    return generation_defaults_from_file(path)
