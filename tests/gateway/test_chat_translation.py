"""A chat check's error, named in the client's API: the param and the message."""

from __future__ import annotations

from gateway.chat.translation import FieldNames
from gateway.http.errors import APIError, bad_request

NAMES = FieldNames({"stop": "stop_sequences", "messages[3]": "messages[1].content[2]", "messages": "input",
                    "tools[0].function.parameters": "tools[0].input_schema", "max_tokens": "max_output_tokens"})


def test_the_longest_mapped_prefix_is_replaced():
    assert NAMES.client_param("messages[3].content") == "messages[1].content[2].content"
    assert NAMES.client_param("messages") == "input"
    assert NAMES.client_param("tools[0].function.parameters") == "tools[0].input_schema"
    assert NAMES.client_param("stop_token_ids") == "stop_token_ids"  # "stop" is not its prefix
    assert NAMES.client_param("temperature") == "temperature"


def test_the_message_names_the_clients_field():
    renamed = NAMES.renamed(bad_request("stop may hold at most 4 strings, got 5.", "stop"))
    assert (renamed.param, renamed.message) == ("stop_sequences", "stop_sequences may hold at most 4 strings, got 5.")
    context = APIError(400, "However, you requested 9000 tokens. Please reduce the length of the prompt or "
                            "max_tokens (at most 10 here).", param="max_tokens", code="context_length_exceeded")
    renamed = NAMES.renamed(context)
    assert "max_output_tokens (at most 10 here)" in renamed.message and renamed.code == "context_length_exceeded"
    renamed = NAMES.renamed(bad_request("Your prompt is too long.", "messages"))
    assert renamed.message == "input: Your prompt is too long."
    same = bad_request("temperature must be in [0, 2].", "temperature")
    assert NAMES.renamed(same) is same
