"""Chat template options: the request's template and variables, the server's defaults, and their checks."""

from __future__ import annotations

import argparse

import openai
import pytest

from gateway.chat.request import ChatMessage
from gateway.chat.template import ChatOptions, render_chat
from stagemesh import openai_flags
from stagemesh_core.errors import UserError

from .conftest import MODEL

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"


def test_request_template_and_kwargs_reach_the_prompt(client, stage, tokenizer):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"chat_template": TEMPLATE, "chat_template_kwargs": {"shout": True}})
    assert tokenizer.decode(list(stage.requests[-1].prompt_token_ids)) == "hi!!"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_continue_final_message_leaves_the_assistant_turn_open(tokenizer):
    messages = [ChatMessage(role="user", content="Count"), ChatMessage(role="assistant", content="1, 2,")]
    ids = render_chat(messages, tokenizer, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert tokenizer.decode(list(ids)).endswith("1, 2,")


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    openai_flags.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_server_flags_become_the_defaults(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    d = openai_flags.openai_defaults(_args(chat_template=template, chat_template_kwargs='{"shout": true}',
                                           tool_call_parser="mistral"), str(tmp_path))
    assert d.chat_template == TEMPLATE and d.chat_template_kwargs == {"shout": True}
    assert d.tool_call_parser == "mistral" and d.generation.temperature == 0.3
    assert openai_flags.openai_defaults(_args(generation_config="vllm"), str(tmp_path)).generation.temperature is None
    for bad in ({"chat_template_kwargs": "[1]"}, {"chat_template_kwargs": "{"}, {"generation_config": "/nowhere"}):
        with pytest.raises(UserError, match="--"):
            openai_flags.openai_defaults(_args(**bad), str(tmp_path))
