"""Least outstanding requests, ties round-robin."""

from __future__ import annotations

from gateway.mesh.balancer import LeastOutstandingBalancer


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


def test_an_affinity_keeps_its_replica_whatever_the_load():
    b = LeastOutstandingBalancer()
    first = b.pick(["a", "b", "c"], affinity="session-1")
    b.acquire(first)
    b.acquire(first)
    assert [b.pick(["a", "b", "c"], affinity="session-1") for _ in range(4)] == [first] * 4
    assert b.pick(["a", "b", "c"], affinity="session-1", exclude=[first]) != first  # failover goes elsewhere
    assert b.pick(["a", "b", "c"], affinity="session-1", cap=2) != first  # a full replica is skipped
    spread = {b.pick(["a", "b", "c"], affinity=f"session-{i}") for i in range(30)}
    assert spread == {"a", "b", "c"}
