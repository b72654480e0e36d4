"""OpenAI response and stream-chunk shapes, as plain dicts.

Contract: every function returns exactly the JSON OpenAI sends for that
object (explicit nulls included, since SDKs and clients read them), for the
two kinds of endpoint: ``"chat"`` (``chat.completion`` /
``chat.completion.chunk``) and ``"completion"`` (``text_completion``).
Each chunk is one ``data:`` event (``gateway.http.sse``); ``SSE_DONE`` ends a stream.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "completion"]
SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` are the prompt positions the stages restored from
    their prefix cache instead of computing (OpenAI always sends the field; vLLM behind a flag)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class ResponseHeader:
    """What every object of one response shares."""

    kind: Kind
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @staticmethod
    def new(kind: Kind, model: str) -> ResponseHeader:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return ResponseHeader(kind, model, f"{prefix}-{uuid.uuid4().hex}")

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, texts: list[str | None], finish_reasons: list[str | None], use: dict[str, int],
             logprobs: list[dict[str, Any] | None] | None = None,
             tool_calls: list[list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """``logprobs``: each choice's ``logprobs`` object (``gateway.openai.logprobs``), or None throughout;
        ``tool_calls``: each chat choice's calls (``message.tool_calls``; left out when empty)."""
        lps = logprobs or [None] * len(texts)
        triples = list(enumerate(zip(texts, finish_reasons, lps, strict=True)))
        if self.kind == "chat":
            choices = []
            for i, (t, f, lp) in triples:
                message: dict[str, Any] = {"role": "assistant", "content": t, "refusal": None}
                if tool_calls and tool_calls[i]:
                    message["tool_calls"] = tool_calls[i]
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": f})
            return {**self._base("chat.completion"), "choices": choices, "usage": use}
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": f} for i, (t, f, lp) in triples]
        return {**self._base("text_completion"), "choices": choices, "usage": use}

    def chunk(self, index: int, text: str | None, finish_reason: str | None, *, role: bool = False,
              include_usage: bool = False, logprobs: dict[str, Any] | None = None,
              delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One choice's stream chunk. Chat: ``role`` opens the choice; text None gives an empty delta;
        ``delta`` replaces the text's (tool-call deltas)."""
        if self.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
            out = {**self._base("chat.completion.chunk"),
                   "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason}]}
        else:
            out = {**self._base("text_completion"),
                   "choices": [{"index": index, "text": text or "", "logprobs": logprobs,
                                "finish_reason": finish_reason}]}
        if include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last when usage is requested
        return out

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._base(obj), "choices": [], "usage": use}
