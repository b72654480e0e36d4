"""/openapi.json tells the truth, and a bounded schemathesis pass finds no server error, no undocumented
status and no undocumented content type (real gateway, real tokenizer, a fake stage behind it)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks


@pytest.fixture
def document(server) -> dict:
    return httpx.get(f"{server.url}/openapi.json").json()


def test_statuses_and_content_types_are_the_real_ones(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            assert responses["500"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
            if method == "post":
                assert "400" in responses, (method, path)
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"401", "404", "503", "504"} <= set(chat) and "text/event-stream" in chat["200"]["content"]
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_request_schemas_are_as_tight_as_the_validation(document):
    schemas = document["components"]["schemas"]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant",
                                                                    "tool"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert prompt[1]["items"]["maximum"] == 49151  # the vocabulary of the served model
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert (chat["temperature"]["minimum"], chat["temperature"]["maximum"]) == (0, 2)
    assert chat["max_tokens"]["maximum"] == 2047 and chat["top_logprobs"]["maximum"] == 20


_CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance]


def test_schemathesis_finds_no_server_error_nor_undocumented_status(server, stage, healthy_mesh):
    """Every operation, a bounded number of generated requests each (schemathesis' pytest plugin does not
    run under this pytest, so the operations are driven through hypothesis directly)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        @given(operation.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case):
            case.call_and_validate(checks=_CHECKS, excluded_checks=[c for c in _ALL if c not in _CHECKS])

        run()


_ALL = [checks.positive_data_acceptance, checks.negative_data_rejection, checks.response_schema_conformance,
        checks.missing_required_header, checks.unsupported_method, checks.use_after_free,
        checks.ensure_resource_availability, checks.ignored_auth, checks.response_headers_conformance,
        checks.max_response_time]
