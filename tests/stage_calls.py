"""One prompt over a ``GenerateStream`` call of its own: for tests that talk to an entry stage's gRPC directly."""

from __future__ import annotations

import grpc

from stagemesh_core.v1 import stage_pb2


class PromptRefused(grpc.RpcError):
    """The stage ended the prompt with an error update: its status code and message, as a failed call has."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def generate(stub, request: stage_pb2.GenerateRequest, *, metadata, timeout: float = 300) -> list[int]:
    """``request``'s token ids, in order; raises ``PromptRefused`` (or the call's ``grpc.RpcError``)."""
    tokens: list[int] = []
    start = stage_pb2.GenerateStreamRequest(start=request)
    for message in stub.GenerateStream(iter([start]), timeout=timeout, metadata=metadata):
        for update in message.updates:
            if update.error_code:
                raise PromptRefused(_STATUS_BY_VALUE.get(update.error_code, grpc.StatusCode.UNKNOWN),
                                    update.error_message)
            tokens += update.response.token_ids
    return tokens
