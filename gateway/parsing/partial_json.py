"""The value a JSON text cut short stands for: what a tool call's arguments hold when ``max_tokens`` ended them.

Contract: ``partial_object(text)`` is the JSON object ``text`` begins (pure): ``text`` itself when it parses,
else its longest prefix that ends on a whole member or element, with a string value being written kept as far
as it goes and every open string, array and object closed; ``{}`` when not even that is an object. Anthropic's
Messages API hands a ``tool_use`` block's ``input`` cut by ``max_tokens`` back this way (its SDKs parse the
streamed ``partial_json`` pieces the same), so an unstreamed reply and a streamed one agree.
"""

from __future__ import annotations

import json
from typing import Any

_CLOSERS = {"{": "}", "[": "]"}


def partial_object(text: str) -> dict[str, Any]:
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        return whole
    for candidate in _closings(text):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def _closings(text: str) -> list[str]:
    """Closed forms of ``text``'s prefixes, longest first: the whole text with an open value string closed,
    then each point after a whole member, element or opened container, nearest the end first (one pass)."""
    stack: list[str] = []
    cuts: list[tuple[int, str]] = []  # (prefix length, closers) where the prefix ends on something whole
    in_string = escaped = False
    string_is_key = False
    expect_key = False  # inside an object, before a member's key
    value_start = -1  # where a bare literal (number, true, false, null) began
    i = 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if not string_is_key:
                    cuts.append((i + 1, _closed(stack)))
            continue
        if value_start >= 0 and ch in ",}] \t\r\n":
            cuts.append((i, _closed(stack)))
            value_start = -1
        if ch == '"':
            in_string, string_is_key = True, expect_key and bool(stack) and stack[-1] == "{"
        elif ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
            cuts.append((i + 1, _closed(stack)))
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            cuts.append((i + 1, _closed(stack)))
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            expect_key = False
        elif not ch.isspace() and value_start < 0:
            value_start = i
    out = []
    if in_string and not string_is_key:
        # A string value being written: keep what it holds so far (a dangling escape dropped).
        body = text[:-1] if escaped else text
        out.append(body + '"' + _closed(stack))
    if value_start >= 0:
        out.append(text + _closed(stack))  # a literal at the very end, whole if it parses
    out += [text[:end] + closers for end, closers in reversed(cuts)]
    return out


def _closed(stack: list[str]) -> str:
    return "".join(_CLOSERS[c] for c in reversed(stack))
