"""Stop strings across chunk boundaries."""

from __future__ import annotations

import pytest

from gateway.parsing.stop_strings import StopStringMatcher


def run(stops, chunks):
    m = StopStringMatcher(tuple(stops))
    out = []
    for c in chunks:
        emit, stopped = m.feed(c)
        out.append(emit)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def test_no_stops_passes_text_through():
    assert run([], ["a", "b"]) == (["a", "b", ""], False)


def test_stop_spanning_chunks_is_cut_and_not_shown():
    out, stopped = run(["o w"], ["Hel", "lo", " wor", "ld"])
    assert stopped and "".join(out) == "Hell"


def test_possible_prefix_is_held_then_released():
    m = StopStringMatcher(("<END>",))
    assert m.feed("abc<") == ("abc", False)
    assert m.feed("EN") == ("", False)
    assert m.feed("x") == ("<ENx", False)
    assert m.feed("<E") == ("", False)
    assert m.flush() == "<E"


def test_earliest_of_several_stops_wins():
    out, stopped = run(["world", "lo"], ["hello world"])
    assert stopped and out == ["hel"]


def test_stop_at_the_very_start_and_in_one_char_chunks():
    out, stopped = run(["\n\n"], list("ab\n\ncd"))
    assert stopped and "".join(out) == "ab"
    out, stopped = run(["STOP"], ["STOP now"])
    assert stopped and out == [""]


def test_fed_after_stop_is_an_error():
    m = StopStringMatcher(("x",))
    assert m.feed("ax") == ("a", True)
    with pytest.raises(RuntimeError):
        m.feed("more")
