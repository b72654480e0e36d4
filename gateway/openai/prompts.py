"""Completion prompts to token ids.

Contract: ``completion_prompts(prompt, tokenizer, vocab)`` accepts OpenAI's four
prompt shapes (a string, a list of token ids, a list of strings, a list of
lists of token ids) and returns one non-empty tuple of token ids per prompt,
or raises a 400 ``APIError`` with ``param="prompt"``. Strings are encoded with
the tokenizer's special tokens (BOS where the model wants one) unless
``add_special_tokens=False``, as vLLM does for completions; token ids must be
in the vocabulary. ``echo_texts(prompt, ids, tokenizer)`` is each prompt's text
as ``echo`` shows it: a string prompt as sent, token ids decoded.
"""

from __future__ import annotations

from typing import Any

from gateway.http.errors import bad_request

MAX_PROMPTS = 32  # a batch of prompts times n choices are all concurrent calls


def completion_prompts(prompt: str | list[int] | list[str] | list[list[int]], tokenizer: Any, vocab: int, *,
                       add_special_tokens: bool = True) -> list[tuple[int, ...]]:
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty.", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"At most {MAX_PROMPTS} prompts per request, got {len(items)}.", "prompt")
    out: list[tuple[int, ...]] = []
    for item in items:
        ids = tuple(tokenizer.encode(item, add_special_tokens=add_special_tokens)) if isinstance(item, str) \
            else tuple(item)
        if not ids:
            raise bad_request("prompt must contain at least one token.", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} in prompt is out of vocabulary (size {vocab}).", "prompt")
        out.append(ids)
    return out


def echo_texts(prompt: str | list[int] | list[str] | list[list[int]], ids: list[tuple[int, ...]],
               tokenizer: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    return [tokenizer.decode(list(i), skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
