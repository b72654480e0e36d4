"""KV caches per stage: prompt chunks in standalone caches, decodes in groups that follow the batches."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from stage_worker.cache.kv_store import KVStore
from stage_worker.transport.wire import WireMismatchError

LAYERS, HEADS, DIM = 2, 3, 4


def _store(max_sequences=8):
    return KVStore(lambda: [KVCache() for _ in range(LAYERS)], max_sequences)


def _kv(seq_id, n, start=0):
    """Deterministic keys/values for positions [start, start + n) of a sequence."""
    base = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None] + 100 * seq_id
    return mx.broadcast_to(base, (1, HEADS, n, DIM)), mx.broadcast_to(-base, (1, HEADS, n, DIM))


def _prefill(store, seq_id, n):
    for cache in store.for_chunk(seq_id, 0, True, n):
        cache.update_and_fetch(*_kv(seq_id, n))


def _decode(store, seq_ids, positions):
    caches = store.for_decode(seq_ids, positions)
    for cache in caches:
        keys = mx.concatenate([_kv(s, 1, p)[0] for s, p in zip(seq_ids, positions)])
        values = mx.concatenate([_kv(s, 1, p)[1] for s, p in zip(seq_ids, positions)])
        cache.update_and_fetch(keys, values)
    return caches


def _history(store, seq_id):
    """The keys a sequence's first layer holds, wherever it lives now (extracts it to standalone)."""
    caches = store.for_chunk(seq_id, store._positions[seq_id], False, 0)
    return caches[0].keys[..., : caches[0].offset, :]


def test_groups_follow_the_batches_and_keep_every_sequences_history():
    store = _store()
    _prefill(store, 1, 3)
    _prefill(store, 2, 5)
    first = _decode(store, [1, 2], [3, 5])
    assert _decode(store, [1, 2], [4, 6]) is first  # same members: same group, no copies
    _prefill(store, 3, 2)
    _decode(store, [2, 3], [7, 2])  # 1 leaves (back to standalone), 3 joins
    _decode(store, [1], [5])
    for seq_id, length in ((1, 6), (2, 8), (3, 3)):
        expected = _kv(seq_id, length)[0]
        assert mx.array_equal(_history(store, seq_id), expected).item(), seq_id


def test_a_batch_listing_the_group_in_another_order_reorders_it_in_place():
    store = _store()
    for seq_id, n in ((1, 3), (2, 5), (3, 2)):
        _prefill(store, seq_id, n)
    group = _decode(store, [1, 2], [3, 5])
    # 3 joins and the batch lists 2 before 1: the same group, reordered, not rebuilt from copies.
    assert _decode(store, [3, 2, 1], [2, 6, 4]) is group
    assert store._group_of[1].members == [3, 2, 1]
    assert _decode(store, [1, 3, 2], [5, 3, 7]) is group
    for seq_id, length in ((1, 6), (2, 8), (3, 4)):
        assert mx.array_equal(_history(store, seq_id), _kv(seq_id, length)[0]).item(), seq_id


def test_release_frees_grouped_and_standalone_sequences():
    store = _store()
    _prefill(store, 1, 2)
    _prefill(store, 2, 2)
    _decode(store, [1, 2], [2, 2])
    store.release(1)
    assert 1 not in store and len(store) == 1
    _decode(store, [2], [3])
    store.release(2)
    assert len(store) == 0


def test_a_chunk_that_does_not_continue_its_sequence_is_refused():
    store = _store()
    _prefill(store, 1, 4)
    with pytest.raises(WireMismatchError, match="continues at position 5 but this stage's KV holds 4"):
        store.for_decode([1], [5])
    with pytest.raises(WireMismatchError, match="holds no KV"):
        store.for_decode([9], [0])


def test_more_sequences_than_admitted_is_refused():
    store = _store(max_sequences=1)
    _prefill(store, 1, 1)
    with pytest.raises(WireMismatchError, match="admitted more than --max-num-seqs"):
        store.for_chunk(2, 0, True, 1)


def test_groups_shrink_without_reading_the_device_and_keep_every_sequences_history(monkeypatch):
    """Sequences of different lengths decode together, then leave one at a time and several at once:
    the survivors' keys are exactly their own, and no BatchKVCache.filter/extract (which read the
    left padding back from the device) runs."""
    from mlx_lm.models.cache import BatchKVCache

    def forbidden(*args, **kwargs):
        raise AssertionError("a device read while reshaping a group")

    monkeypatch.setattr(BatchKVCache, "filter", forbidden)
    monkeypatch.setattr(BatchKVCache, "extract", forbidden)
    store = _store()
    lengths = {1: 5, 2: 2, 3: 7, 4: 3}
    for seq_id, n in lengths.items():
        _prefill(store, seq_id, n)
    positions = dict(lengths)
    members = [1, 2, 3, 4]
    for step in range(3):
        _decode(store, members, [positions[m] for m in members])
        for m in members:
            positions[m] += 1
        if step == 0:
            store.release(3)  # the longest leaves: the others' left padding is trimmed
            members = [1, 2, 4]
        elif step == 1:
            store.release_many([1, 4])
            members = [2]
    for seq_id in (2,):
        expected = mx.arange(0, positions[seq_id], dtype=mx.float32) + 100 * seq_id
        assert mx.array_equal(_history(store, seq_id)[0, 0, :, 0], expected).item()
    assert len(store) == 1


def test_tokens_held_counts_every_position_and_drops_with_release():
    """The count the dashboard's KV use reads from another thread: prompt chunks, decodes, releases."""
    store = _store()
    _prefill(store, 1, 3)
    _prefill(store, 2, 5)
    _decode(store, [1, 2], [3, 5])
    assert store.tokens_held == 3 + 5 + 2
    store.release(1)
    assert store.tokens_held == 6
    _prefill(store, 2, 4)  # a new sequence reusing an id starts over
    assert store.tokens_held == 4
    store.release_many([2, 7])
    assert store.tokens_held == 0


def test_the_held_count_reaches_the_stage_stats():
    from stage_worker.engine.stage_status import StageStatus

    store, status = _store(), StageStatus()
    status.watch_kv(store, 1000)
    _prefill(store, 1, 5)
    _prefill(store, 2, 3)
    _decode(store, [1, 2], [5, 3])  # one more token each, now in a decode group
    assert (status.stats().kv_token_capacity, status.stats().kv_tokens) == (1000, 10)
    store.release(1)
    assert status.stats().kv_tokens == 4


# -- prefix entries ------------------------------------------------------------------------------
def test_a_retained_prefix_starts_a_new_sequence_with_a_copy_of_its_first_positions():
    store = _store()
    _prefill(store, 1, 6)
    store.retain(1, entry_id=9, tokens=4)
    store.release(1)
    assert store.prefix_cached_tokens == 4
    caches = store.for_chunk(2, 4, True, 2, prefix_entry=9)
    assert caches[0].offset == 4 and store.prefix_reused_tokens == 4
    for cache in caches:
        cache.update_and_fetch(*_kv(2, 2, 4))
    held = _history(store, 2)
    assert held[0, 0, :, 0].tolist() == [100, 101, 102, 103, 204, 205]
    # the new sequence's writes went to a buffer of its own: the entry still holds sequence 1's keys
    again = store.for_chunk(3, 4, True, 0, prefix_entry=9)
    assert again[0].keys[0, 0, :, 0].tolist() == [100, 101, 102, 103]


def test_a_prefix_is_retained_from_a_decode_group_too():
    store = _store()
    _prefill(store, 1, 3)
    _prefill(store, 2, 5)
    _decode(store, [1, 2], [3, 5])
    store.retain(2, entry_id=4, tokens=4)
    store.release_many([1, 2])
    caches = store.for_chunk(3, 4, True, 0, prefix_entry=4)
    assert caches[1].keys[0, 0, :, 0].tolist() == [200, 201, 202, 203]


def test_evicted_or_unknown_prefix_entries_are_refused_loudly():
    store = _store()
    _prefill(store, 1, 4)
    store.retain(1, entry_id=5, tokens=4)
    with pytest.raises(WireMismatchError, match="known already"):
        store.retain(1, entry_id=5, tokens=4)
    with pytest.raises(WireMismatchError, match="holds 4 positions"):
        store.retain(1, entry_id=6, tokens=8)
    store.evict(5)
    assert store.prefix_cached_tokens == 0 and store.prefix_evicted_tokens == 4
    with pytest.raises(WireMismatchError, match="does not hold"):
        store.for_chunk(2, 4, True, 1, prefix_entry=5)
    with pytest.raises(WireMismatchError, match="no such entry"):
        store.evict(5)
    with pytest.raises(WireMismatchError, match="not 0"):
        store.for_chunk(2, 4, True, 1)


def test_tokens_held_counts_prefix_entries_and_copies():
    store = _store()
    _prefill(store, 1, 6)
    store.retain(1, entry_id=3, tokens=4)
    store.release(1)
    assert store.tokens_held == 4  # the entry's positions
    store.for_chunk(2, 4, True, 1, prefix_entry=3)
    assert store.tokens_held == 4 + 5  # the copy is the new sequence's own
    store.evict(3)
    store.release(2)
    assert store.tokens_held == 0


def test_a_group_step_of_several_tokens_keeps_each_sequences_own_positions_through_rollbacks():
    """Verifications (several tokens) beside a decode: every member writes the widest count, the shorter
    right-padded; the padding and later rolled-back positions are dropped before the group is read again, by
    a release, a reorder, a retained prefix or an extraction alike."""
    store = _store()
    for seq_id, n in ((1, 3), (2, 5), (3, 4)):
        _prefill(store, seq_id, n)
    lengths = [4, 1, 2]
    caches = store.for_decode([1, 2, 3], [3, 5, 4], lengths)
    for cache in caches:  # the stage's forward writes 4 columns per member, the real ones first
        keys = mx.concatenate([mx.pad(_kv(s, n, p)[0], [(0, 0), (0, 0), (0, 4 - n), (0, 0)], constant_values=-7.0)
                               for s, n, p in zip((1, 2, 3), lengths, (3, 5, 4))])
        cache.update_and_fetch(keys, -keys)
    assert store._positions == {1: 7, 2: 6, 3: 6} and store.tokens_held == 19
    # Sequence 1 kept 2 of its 4 (rolls back to 5), 3 kept both of its 2: one group step, each one on.
    _decode(store, [1, 3, 2], [5, 6, 6])
    store.retain(2, 9, 4)  # a prefix sliced out of the group after the rollbacks
    store.release(3)
    expected = {1: _kv(1, 6), 2: _kv(2, 7)}
    assert mx.array_equal(store._prefixes[9][0].keys, _kv(2, 4)[0]).item()
    for seq_id, (keys, _) in expected.items():
        assert mx.array_equal(_history(store, seq_id), keys).item(), seq_id
    assert store.tokens_held == 6 + 7 + 4
