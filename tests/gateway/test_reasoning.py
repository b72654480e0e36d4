"""Reasoning told apart from the answer: any split of a reply streams to the whole reply's parts."""

from __future__ import annotations

import pytest

from gateway.parsing.reasoning import ReasoningSplitter, opens_reasoning, split_reasoning, template_reasons

REPLIES = [
    ("<think>Paris is in France.</think>\n\nHello there!", False, ("Paris is in France.", "Hello there!")),
    ("  <think>a < b</think>Hi", False, ("a < b", "Hi")),
    ("Paris is in France.</think>\n\nHello!", True, ("Paris is in France.", "Hello!")),
    ("Hello <think> there", False, (None, "Hello <think> there")),  # only a reply's opening tag starts reasoning
    ("<thi", False, (None, "<thi")),
    ("<think>cut short", False, ("cut short", "")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text, inside, expected", REPLIES)
def test_whole_reply(text, inside, expected):
    assert split_reasoning(text, inside) == expected


@pytest.mark.parametrize("text, inside, expected", REPLIES)
def test_every_split_of_the_reply_streams_the_same(text, inside, expected):
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1):
            splitter = ReasoningSplitter(inside)
            pieces = [p for part in (text[:cut], text[cut:cut2], text[cut2:]) for p in splitter.feed(part)]
            pieces += splitter.finish()
            reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
            answer = "".join(t for kind, t in pieces if kind == "text")
            assert (reasoning or (None if expected[0] is None else ""), answer) == expected, (cut, cut2)


def test_held_back_is_only_what_could_be_a_tag():
    splitter = ReasoningSplitter(inside=True)
    assert splitter.feed("step one </thi") == [("reasoning", "step one ")]
    assert splitter.feed("nk>\n") == []  # the whitespace after the tag waits for the answer
    assert splitter.feed("Answer") == [("text", "Answer")]


def test_which_templates_and_prompts_reason():
    assert template_reasons("{{ '<think>' }}...{{ '</think>' }}") and not template_reasons("<|im_start|>")
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("<think>\n\n</think>\n\n")
