"""``stagemesh serve``'s flags for the OpenAI surface's server-side defaults (vLLM's names).

Contract: ``add_arguments(parser)`` adds ``--chat-template`` (a Jinja file, or the template
itself), ``--chat-template-kwargs`` (a JSON object of template variables, e.g.
``'{"enable_thinking": false}'``), ``--tool-call-parser`` (hermes, llama3_json, mistral) and
``--generation-config`` (``auto``: the model directory's
``generation_config.json``; ``vllm``: none, OpenAI's defaults; or a folder holding one) and
``--[no-]structured-output-strict`` (JSON Schemas close their objects; on by default).
``openai_defaults(args, model_path)`` turns them into ``gateway.chat.defaults.OpenAIDefaults``
or raises ``UserError`` naming the flag.
"""

from __future__ import annotations

import argparse
import json
import os

from gateway.chat.defaults import (
    GENERATION_CONFIG_FILE,
    GenerationDefaults,
    OpenAIDefaults,
    generation_defaults_from_file,
    model_generation_defaults,
)
from gateway.parsing.tool_parsers import PARSERS
from stagemesh_core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None,
                        help="chat template replacing the model's: a Jinja file or the template text")
    parser.add_argument("--chat-template-kwargs", default=None,
                        help="JSON object of chat template variables every request gets, e.g. "
                             "'{\"enable_thinking\": false}' (a request's chat_template_kwargs override them)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="how the model writes tool calls (default: from its chat template, else hermes)")
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults for unset request fields: auto (the model's generation_config.json), "
                             "vllm (none), or a folder holding a generation_config.json (default %(default)s)")
    parser.add_argument("--structured-output-strict", action=argparse.BooleanOptionalAction, default=True,
                        help="enforce JSON Schemas (response_format, guided_json, forced tool calls) strictly: an "
                             "object that declares properties takes no others unless its schema says so "
                             "(default on; --no-structured-output-strict follows additionalProperties' own default)")


def openai_defaults(args: argparse.Namespace, model_path: str) -> OpenAIDefaults:
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    if template is not None and not template.strip():
        raise UserError("--chat-template is empty: give a Jinja file or the template text")
    kwargs: dict = {}
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise UserError(f"--chat-template-kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise UserError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return OpenAIDefaults(generation=_generation(args.generation_config, model_path), chat_template=template,
                          chat_template_kwargs=kwargs, tool_call_parser=args.tool_call_parser,
                          structured_output_strict=args.structured_output_strict)


def _generation(setting: str, model_path: str) -> GenerationDefaults:
    try:
        if setting == "auto":
            return model_generation_defaults(model_path)
        if setting == "vllm":
            return GenerationDefaults()
        path = os.path.join(setting, GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            raise UserError(f"--generation-config {setting}: no {GENERATION_CONFIG_FILE} there; "
                            "give auto, vllm or a folder holding one")
        return generation_defaults_from_file(path)
    except ValueError as e:
        raise UserError(f"--generation-config: {e}") from None
