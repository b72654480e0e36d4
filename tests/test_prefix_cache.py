"""The entry stage's prefix-cache bookkeeping as pure logic: hits, partial blocks, references, eviction, budget."""

import pytest

from stage_worker.cache.prefix_cache import PrefixCache, PrefixHit, block_hashes


def test_block_hashes_chain_every_token_before_them_and_the_salt():
    a = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # the partial last block is not hashed
    assert block_hashes([1, 2, 3, 4], 2) == a
    assert block_hashes([9, 2, 3, 4], 2)[1] != a[1]  # block 2 names its whole prefix, not only its tokens
    assert block_hashes([1, 2, 3, 4], 2, salt=b"other-model/bfloat16") != a


def test_a_finished_sequence_is_found_by_a_prompt_that_starts_alike():
    cache = PrefixCache(block_size=4)
    kept = cache.insert(list(range(10)), kv_tokens=10)
    assert kept.entry_id is not None and kept.tokens == 8  # whole blocks only
    hit = cache.lookup(list(range(10)) + [99])
    assert hit == PrefixHit(kept.entry_id, 8)
    assert (cache.stats.queries, cache.stats.hits) == (11, 8)


def test_a_prefix_that_ends_inside_a_block_reuses_only_the_whole_blocks_before_it():
    cache = PrefixCache(block_size=4)
    entry = cache.insert(list(range(12)), kv_tokens=12).entry_id
    assert cache.lookup([0, 1, 2, 3, 4, 5, 77, 78, 79]) == PrefixHit(entry, 4)  # diverges inside block 2


def test_at_least_one_prompt_token_is_left_to_prefill():
    cache = PrefixCache(block_size=4)
    entry = cache.insert(list(range(12)), kv_tokens=12).entry_id
    assert cache.lookup(list(range(8))) == PrefixHit(entry, 4)  # the whole prompt is cached: keep a block back
    assert cache.lookup(list(range(4))) is None
    assert cache.lookup([0, 1, 2]) is None


def test_only_the_positions_the_stages_hold_are_kept():
    cache = PrefixCache(block_size=4)
    assert cache.insert(list(range(20)), kv_tokens=9).tokens == 8
    assert cache.insert([5, 6, 7], kv_tokens=3).entry_id is None  # no whole block


def test_a_covered_sequence_adds_nothing_and_a_longer_one_supersedes_the_shorter():
    cache = PrefixCache(block_size=2)
    short = cache.insert([1, 2, 3, 4], 4).entry_id
    assert cache.insert([1, 2, 3, 4], 4).entry_id is None
    assert cache.insert([1, 2], 2).entry_id is None
    longer = cache.insert([1, 2, 3, 4, 5, 6], 6)
    assert longer.superseded == (short,) and short not in cache
    assert cache.cached_blocks == 3
    other = cache.insert([1, 2, 9, 9], 4)  # shares a block but is not a prefix of the longer one
    assert other.superseded == () and cache.cached_blocks == 5


def test_references_keep_an_entry_from_eviction_until_released():
    cache = PrefixCache(block_size=2)
    entry = cache.insert([1, 2, 3, 4], 4).entry_id
    assert entry is not None
    hit = cache.lookup([1, 2, 3, 4, 5])
    assert hit is not None and cache.references(entry) == 1
    assert cache.pinned_tokens == 4
    assert cache.evict_to(0) == [] and entry in cache
    cache.release(entry)
    assert cache.evict_to(0) == [entry] and cache.cached_tokens == 0
    assert cache.stats.evicted_blocks == 2
    with pytest.raises(KeyError):
        cache.release(entry)


def test_a_referenced_entry_is_not_superseded():
    cache = PrefixCache(block_size=2)
    short = cache.insert([1, 2], 2).entry_id
    assert cache.lookup([1, 2, 3]) is not None
    assert cache.insert([1, 2, 3, 4], 4).superseded == ()
    assert short in cache


def test_eviction_drops_the_least_recently_used_first_and_only_what_the_budget_needs():
    cache = PrefixCache(block_size=2)
    a = cache.insert([1, 1], 2).entry_id
    b = cache.insert([2, 2], 2).entry_id
    c = cache.insert([3, 3], 2).entry_id
    assert a is not None and b is not None and c is not None
    hit = cache.lookup([1, 1, 5])  # a is now the most recently used
    assert hit is not None
    cache.release(a)
    assert cache.evict_to(4) == [b]
    assert cache.evict_to(4) == []
    assert cache.evict_to(2) == [c]
    assert [e for e in (a, b, c) if e in cache] == [a]


def test_release_without_a_reference_is_an_error():
    cache = PrefixCache(block_size=2)
    entry = cache.insert([1, 2], 2).entry_id
    assert entry is not None
    with pytest.raises(ValueError, match="released more often"):
        cache.release(entry)


def test_the_most_recently_used_of_several_holders_answers():
    cache = PrefixCache(block_size=2)
    first = cache.insert([1, 2, 3, 4], 4).entry_id
    second = cache.insert([1, 2, 5, 6], 4).entry_id
    assert cache.lookup([1, 2, 7]) == PrefixHit(second, 2)
    assert second is not None
    cache.release(second)
    assert cache.lookup([1, 2, 3, 4, 8]) == PrefixHit(first, 4)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block size"):
        PrefixCache(block_size=0)
