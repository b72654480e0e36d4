"""Least outstanding requests, ties round-robin."""

from __future__ import annotations

from gateway.balancer import LeastOutstandingBalancer


def test_ties_take_turns():
    b = LeastOutstandingBalancer()
    picks = [b.pick(["a", "b", "c"]) for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_outstanding_wins():
    b = LeastOutstandingBalancer()
    b.acquire("a")
    b.acquire("a")
    b.acquire("b")
    assert [b.pick(["a", "b", "c"]) for _ in range(3)] == ["c", "c", "c"]
    b.acquire("c")
    b.acquire("c")
    assert b.pick(["a", "b", "c"]) == "b"
    b.release("a")
    b.release("a")
    assert b.outstanding("a") == 0 and "a" not in b.snapshot()
    assert b.pick(["a", "b", "c"]) == "a"


def test_exclude_and_cap():
    b = LeastOutstandingBalancer()
    b.acquire("a")
    assert b.pick(["a", "b"], exclude=["b"]) == "a"
    assert b.pick(["a", "b"], exclude=["b"], cap=1) is None
    assert b.eligible(["a", "b"], cap=1) == ["b"]
    assert b.pick([]) is None
