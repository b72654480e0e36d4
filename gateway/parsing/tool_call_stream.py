"""Tool calls read from a streamed reply as it arrives: text deltas in, content and call deltas out.

Contract: ``ToolCallStream(fmt)`` (``fmt`` a ``gateway.parsing.tool_parsers.ToolFormat``) is fed the reply's text
deltas (``feed(text)``) and returns, for each, the events to send now; ``finish()`` returns the last ones.
Events: ``ContentDelta(text)`` (text before the calls), ``CallStart(index, id, name)`` (a call, as soon as its
name is complete; indexes 0, 1, ... in order) and ``ArgumentsDelta(index, text)`` (the next piece of that
call's arguments, as the model writes them). Fed any split of a text, the content and calls it gives equal
``fmt.parse``'s whenever that text is well formed or not a call at all, the pieces adding up to exactly
``fmt.parse``'s ``arguments``. A stream cannot take back what it sent: when a call whose name was sent turns
out malformed or cut short, ``complete`` is False and the rest is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .tool_parsers import (
    ARGUMENT_KEYS,
    ToolFormat,
    arguments_text,
    call_from_members,
    new_call_id,
    object_members,
    skip_ws,
)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


class _Malformed(Exception):
    """The text stops being the format's calls here."""


class _ValueScan:
    """Where one JSON value ends, fed character by character (strings, escapes, nesting; not validated)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = self.in_string = self.escaped = self.scalar = self.done = False

    def scan(self, text: str, i: int) -> int:
        while i < len(text) and not self.done:
            c = text[i]
            if not self.started:
                self.started = True
                self.in_string, self.scalar = c == '"', c not in '"{['
                self.depth = 1 if c in "{[" else 0
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif self.scalar:
                if c in ",}] \t\n\r":
                    self.done = True
                    return i  # the delimiter belongs to what follows
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            i += 1
        return i


class _Call:
    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_call_id()
        self.name: str | None = None
        self.arguments = ""
        self.sent = -1  # -1: CallStart not sent; else how many characters of arguments were
        self.complete = False


def _string_end(text: str, i: int) -> int:
    """The index after the JSON string opening at ``text[i]``, or -1 when it is not complete yet."""
    escaped = False
    for j in range(i + 1, len(text)):
        if escaped:
            escaped = False
        elif text[j] == "\\":
            escaped = True
        elif text[j] == '"':
            return j + 1
    return -1


def _partial(text: str, i: int, word: str) -> bool:
    """``text[i:]`` is a proper beginning of ``word`` (more text may complete it)."""
    return len(text) - i < len(word) and word.startswith(text[i:])


class ToolCallStream:
    """Only what could still begin a call is held back: a partial marker (``<tool_c``), the whitespace before
    it (the whole-text parser drops it), and for formats whose calls open the text (llama3, ``required``) the
    leading whitespace and tag until the first character decides. Text that turns out not to be a call before
    any call started is sent as content.

    How (after vLLM's ``extract_tool_calls_streaming``, without its partial-JSON re-parse and diff): a cursor
    walks the text once through the format's grammar (content, marker, call list, call object, member, value);
    a JSON value is followed character by character (strings, escapes, nesting) only to know where it ends,
    the arguments object's characters being sent as they pass; a finished call object is checked with the
    whole-text parser's own rules (``object_members``, ``call_from_members``), so both agree on what a call is.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self._fmt = fmt
        self._buf = ""
        self._pos = 0  # the next character to read
        self._held = 0  # the first character not yet sent as content
        self._state = "content" if fmt.marker else "start"
        self._events: list[Event] = []
        self.calls: list[_Call] = []
        self.broken = False
        # the call object being read
        self._obj = 0  # where it starts
        self._key: str | None = None
        self._first_key = True  # a '}' may close the object here
        self._tag_read = False
        self._role = ""  # of the value being read: name, args, args-string, skip
        self._value = 0
        self._scan = _ValueScan()
        self._lone = False  # an array format's lone object

    @property
    def complete(self) -> bool:
        """At least one call was made, and every call is whole."""
        return bool(self.calls) and not self.broken and all(c.complete for c in self.calls)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run()
        return self._take()

    def finish(self) -> list[Event]:
        self._run()
        if self._state in ("content", "start") or not self._started():
            self.calls.clear()
            self._send_content(len(self._buf))  # what was held (whitespace, a partial marker) or not a call
        elif self._state not in ("open", "done", "text") and not (
                self._state == "after_call" and not (self._fmt.array and not self._lone)):
            self.broken = True  # cut short inside a call (or before an array's closing bracket)
        return self._take()

    # -- the walk --------------------------------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _started(self) -> bool:
        return any(c.sent >= 0 for c in self.calls)

    def _send_content(self, end: int) -> None:
        if end > self._held:
            self._events.append(ContentDelta(self._buf[self._held:end]))
            self._held = end

    def _run(self) -> None:
        step = {"content": self._content, "start": self._start, "text": self._text, "list": self._list,
                "first_item": self._first_item, "open": self._open, "after_call": self._after_call,
                "obj": self._object_open, "key": self._key_or_end, "colon": self._colon, "value": self._value_start,
                "in_value": self._in_value, "after_value": self._after_value}
        while self._state not in ("done", "broken"):
            try:
                if not step[self._state]():
                    return
            except (_Malformed, ValueError):
                if self._started():
                    self.broken = True
                    self._state = "broken"
                else:  # nothing was sent as a call: all of it is content after all
                    self.calls.clear()
                    self._state = "text"

    def _content(self) -> bool:
        marker, buf = self._fmt.marker, self._buf
        at = buf.find(marker, self._pos)
        if at < 0:
            keep = next((k for k in range(min(len(marker) - 1, len(buf)), 0, -1) if buf.endswith(marker[:k])), 0)
            self._pos = max(self._held, len(buf) - keep)
            self._send_content(self._held + len(buf[self._held:self._pos].rstrip()))
            return False
        self._send_content(self._held + len(buf[self._held:at].rstrip()))  # the whitespace before goes
        self._pos = at if self._fmt.call_open else at + len(marker)
        self._state = "open" if self._fmt.call_open else "list"
        return True

    def _start(self) -> bool:
        i = skip_ws(self._buf, self._pos)
        tag = "" if self._tag_read else self._fmt.tag
        if i == len(self._buf) or (tag and _partial(self._buf, i, tag)):
            return False
        if tag and self._buf.startswith(tag, i):
            self._pos = i + len(tag)
            self._tag_read = True
            return True
        self._pos = i
        if self._fmt.array and self._buf[i] in "[{":
            self._state = "list"
        elif self._buf[i] == "{":
            self._new_call()
        else:
            self._state = "text"
        return True

    def _text(self) -> bool:
        self._send_content(len(self._buf))
        return False

    def _char(self) -> str | None:
        self._pos = skip_ws(self._buf, self._pos)
        return self._buf[self._pos] if self._pos < len(self._buf) else None

    def _list(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c == "[":
            self._pos += 1
            self._state = "first_item"
        elif c == "{":
            self._lone = True
            self._new_call()
        else:
            raise _Malformed
        return True

    def _first_item(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c == "]":
            raise _Malformed  # no call: the whole-text parser calls it content too
        self._new_call()
        return True

    def _open(self) -> bool:
        at = self._buf.find(self._fmt.call_open, self._pos)
        if at < 0:
            return False  # text between or after calls is not part of the reply
        self._pos = at + len(self._fmt.call_open)
        self._new_call()
        return True

    def _after_call(self) -> bool:
        c = self._char()
        if c is None:
            return False
        fmt, buf, i = self._fmt, self._buf, self._pos
        if fmt.call_close:
            if _partial(buf, i, fmt.call_close):
                return False
            if not buf.startswith(fmt.call_close, i):
                raise _Malformed
            self._pos += len(fmt.call_close)
            self._state = "open"
        elif fmt.array and not self._lone:
            if c not in ",]":
                raise _Malformed
            self._pos += 1
            if c == ",":
                self._new_call()
            else:
                self._state = "done"
        elif fmt.separator and _partial(buf, i, fmt.separator):
            return False
        elif fmt.separator and buf.startswith(fmt.separator, i):
            self._pos += len(fmt.separator)
            self._new_call()
        else:
            self._state = "done"
        return True

    def _new_call(self) -> None:
        self.calls.append(_Call(len(self.calls)))
        self._state = "obj"

    # -- one call object ----------------------------------------------------------------------------------------

    def _object_open(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c != "{":
            raise _Malformed
        self._obj, self._first_key = self._pos, True
        self._pos += 1
        self._state = "key"
        return True

    def _key_or_end(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c == "}" and self._first_key:
            return self._object_end()
        self._first_key = False
        if c != '"':
            raise _Malformed
        end = _string_end(self._buf, self._pos)
        if end < 0:
            return False
        self._key = json.loads(self._buf[self._pos:end])
        self._pos = end
        self._state = "colon"
        return True

    def _colon(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c != ":":
            raise _Malformed
        self._pos += 1
        self._state = "value"
        return True

    def _value_start(self) -> bool:
        c = self._char()
        if c is None:
            return False
        call = self.calls[-1]
        self._role = "skip"
        if self._key == "name" and call.name is None:
            self._role = "name"
        elif self._key in ARGUMENT_KEYS and not call.arguments:
            self._role = "args" if c == "{" else "args-string"
        self._value, self._scan = self._pos, _ValueScan()
        self._state = "in_value"
        return True

    def _in_value(self) -> bool:
        call, start = self.calls[-1], self._pos
        self._pos = self._scan.scan(self._buf, self._pos)
        if self._role == "args":
            call.arguments += self._buf[start:self._pos]
        if not self._scan.done:
            self._progress(call)
            return False
        raw = self._buf[self._value:self._pos]
        if self._role == "name":
            name = json.loads(raw)
            if not isinstance(name, str):
                raise _Malformed
            call.name = name
        elif self._role == "args-string":
            text = arguments_text(json.loads(raw), raw)
            if text is None:
                raise _Malformed  # arguments must be an object or a string holding one
            call.arguments = text
        self._progress(call)
        self._state = "after_value"
        return True

    def _after_value(self) -> bool:
        c = self._char()
        if c is None:
            return False
        if c == ",":
            self._pos += 1
            self._state = "key"
            return True
        if c != "}":
            raise _Malformed
        return self._object_end()

    def _object_end(self) -> bool:
        self._pos += 1
        call = self.calls[-1]
        members, _ = object_members(self._buf, self._obj)  # the whole-text parser's own rules decide
        found = call_from_members(members)
        if found is None:
            raise _Malformed
        if not call.arguments:
            call.arguments = found[1]  # no arguments given: {}
        if found != (call.name, call.arguments):
            raise _Malformed
        self._progress(call)
        call.complete = True
        self._state = "after_call"
        return True

    def _progress(self, call: _Call) -> None:
        if call.name is None:
            return  # arguments written before the name wait for it
        if call.sent < 0:
            self._events.append(CallStart(call.index, call.id, call.name))
            call.sent = 0
        if len(call.arguments) > call.sent:
            self._events.append(ArgumentsDelta(call.index, call.arguments[call.sent:]))
            call.sent = len(call.arguments)

