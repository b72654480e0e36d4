"""Cache-aware replica choice: a conversation's later turns go where its first went, unless that replica is busy.

Pure logic over the balancer and the prefix index (the gateway's own books); tests/e2e/test_prefix_routing_e2e.py
runs it against a served ``-dp 2`` mesh.
"""

from __future__ import annotations

from gateway.mesh.balancer import LeastOutstandingBalancer
from gateway.mesh.prefix_routing import PrefixIndex, choose_by_prefix, loaded_far_past

SYSTEM = list(range(1000, 1064))  # 4 blocks of 16


def _conversation(seed: int, turns: int) -> list[list[int]]:
    """Append-only prompts: each turn is the previous prompt plus 40 new tokens."""
    prompt = SYSTEM + [seed] * 20
    out = []
    for turn in range(turns):
        prompt = prompt + [seed * 100 + turn] * 40
        out.append(list(prompt))
    return out


def _route(b: LeastOutstandingBalancer, prompt: list[int], keys=("a", "b")):
    assert b.prefix_index is not None
    return b.route(list(keys), blocks=b.prefix_index.blocks(prompt))


def test_every_later_turn_lands_where_the_first_did():
    b = LeastOutstandingBalancer(PrefixIndex(16))
    conversations = [_conversation(seed, 5) for seed in (1, 2, 3, 4)]
    first = {}
    for turn in range(5):
        for seed, prompts in enumerate(conversations):
            route = _route(b, prompts[turn])
            if turn == 0:
                first[seed] = route.key
                b.acquire(route.key)  # the four conversations start together
            else:
                assert route.key == first[seed] and route.policy == "prefix", (seed, turn, route)
                assert route.matched_blocks >= len(prompts[turn - 1]) // 16
        if turn == 0:
            for key in first.values():
                b.release(key)
    assert set(first.values()) == {"a", "b"}  # conversations sharing a system prompt still spread


def test_a_shared_system_prompt_alone_does_not_pin_everyone_to_one_replica():
    b = LeastOutstandingBalancer(PrefixIndex(16))
    keys = []
    for seed in range(8):
        route = _route(b, SYSTEM + [seed] * 30)
        b.acquire(route.key)  # all still running
        keys.append(route.key)
    # The system prompt's blocks match one replica first; once it is far busier, load decides.
    assert abs(keys.count("a") - keys.count("b")) <= 4, keys


def test_a_busy_replica_gives_way_and_a_key_still_wins():
    b = LeastOutstandingBalancer(PrefixIndex(16))
    turns = _conversation(7, 2)
    home = _route(b, turns[0]).key
    other = "b" if home == "a" else "a"
    for _ in range(3):
        b.acquire(home)
    route = _route(b, turns[1])
    assert (route.key, route.policy) == (other, "load")  # 3 in flight against 0: far past
    keyed = b.route(["a", "b"], affinity="session", blocks=b.prefix_index.blocks(turns[1]))
    assert keyed is not None and keyed.policy == "key"


def test_the_policy_alone():
    loads = {"a": 2, "b": 0}.__getitem__
    assert choose_by_prefix(["a", "b"], loads, {"a": 2, "b": 0}) == "a"
    assert choose_by_prefix(["a", "b"], loads, {"a": 0, "b": 0}) is None  # nothing matched: balance by load
    assert choose_by_prefix(["a", "b"], loads, {"a": 2, "b": 2}) == "b"  # equal matches: the less loaded
    assert not loaded_far_past(2, 0) and loaded_far_past(3, 0) and not loaded_far_past(20, 10)
    assert loaded_far_past(21, 10)


def test_the_index_is_bounded_and_forgets_replicas_that_went():
    index = PrefixIndex(4, max_blocks=3)
    blocks = index.blocks(list(range(20)))  # 5 blocks
    index.record("a", blocks)
    assert index.held_blocks("a") == 3 and index.matched("a", blocks) == 0  # the first ones went first
    index.record("a", blocks[:2])
    assert index.matched("a", blocks) == 2
    index.forget_except(["b"])
    assert index.held_blocks("a") == 0
