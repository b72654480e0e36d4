"""A reply's reasoning (``<think>...</think>``) told apart from its answer, as it streams and as a whole.

Contract:
- ``template_reasons(template)``: the chat template writes reasoning (it mentions ``</think>``: Qwen3,
  DeepSeek-R1, QwQ and their kin). Only then is a reply split; any other model's ``<think>`` is text.
- ``opens_reasoning(prompt_tail)``: the rendered prompt ends inside an open ``<think>`` (templates that start
  the reasoning for the model), so the reply begins as reasoning.
- ``ReasoningSplitter(inside)``: ``feed(text)`` returns ``(kind, text)`` pieces (``"reasoning"`` or
  ``"text"``) to send now; ``finish()`` the rest. Fed any split of a text, the pieces add up to the same
  reasoning and text.
- ``split_reasoning(text, inside)``: the whole reply as ``(reasoning or None, text)``; ``ReasoningDelta`` is a
  piece of reasoning as a stream sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN, CLOSE = "<think>", "</think>"
Kind = Literal["reasoning", "text"]


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


def template_reasons(template: str | None) -> bool:
    return bool(template) and CLOSE in (template or "")


def opens_reasoning(prompt_tail: str) -> bool:
    return prompt_tail.rstrip().endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and might be completed by more text)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningSplitter:
    """A reply may open with ``<think>`` (after whitespace); reasoning ends at ``</think>``; the tags and the
    whitespace right after the closing tag are not sent. Only what could still be a tag is held back."""

    def __init__(self, inside: bool = False) -> None:
        self._state: Literal["start", "reasoning", "after", "text"] = "reasoning" if inside else "start"
        self._held = ""

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        self._held += text
        out: list[tuple[Kind, str]] = []
        while True:
            buf = self._held
            if self._state == "start":
                lead = buf.lstrip()
                if lead.startswith(OPEN):
                    self._held, self._state = lead[len(OPEN):], "reasoning"
                    continue
                if not lead or OPEN.startswith(lead):
                    return out  # whitespace, or the beginning of the tag: wait
                self._state = "text"
                continue
            if self._state == "reasoning":
                at = buf.find(CLOSE)
                if at >= 0:
                    if at:
                        out.append(("reasoning", buf[:at]))
                    self._held, self._state = buf[at + len(CLOSE):], "after"
                    continue
                keep = _partial_suffix(buf, CLOSE)
                if len(buf) > keep:
                    out.append(("reasoning", buf[:len(buf) - keep]))
                self._held = buf[len(buf) - keep:]
                return out
            if self._state == "after":
                lead = buf.lstrip()
                if not lead:
                    return out  # the whitespace after </think> is not part of the answer
                self._held, self._state = lead, "text"
                continue
            if buf:
                out.append(("text", buf))
            self._held = ""
            return out

    def finish(self) -> list[tuple[Kind, str]]:
        held, self._held = self._held, ""
        if not held or self._state == "after":
            return []
        # A reply cut short keeps what it was in: reasoning stays reasoning; a lone "<thi" is text.
        return [("reasoning" if self._state == "reasoning" else "text", held)]


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str]:
    splitter = ReasoningSplitter(inside)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    answer = "".join(t for kind, t in pieces if kind == "text")
    started = inside or text.lstrip().startswith(OPEN)
    return (reasoning if started else None), answer
