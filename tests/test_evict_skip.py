"""An eviction that takes pending runs' blocks (a miss's run, recorded without keys) tells
the index where they are (``skip``: spans of its list) and keeps their records
(``Keyless``) only when a tier below reads them (``RunCounts.spans``): without one, no
record is built. Either way the index unkeys only the other blocks, the dicts stay sound
and the ``BlockRemoved`` names every evicted block."""

from __future__ import annotations

from prefixkv import KVCacheManager
from prefixkv.core.keyless import Keyless
from prefixkv.events import BlockRemoved

BS = 4


def spy(m: KVCacheManager) -> list[tuple[list[tuple[int, int]], object]]:
    """What each call of the index's ``drop`` is given besides the blocks."""
    index = m._index
    drop = index.drop
    calls: list[tuple[list[tuple[int, int]], object]] = []

    def spied(blocks, skip=(), keyless=None):
        calls.append((list(skip), keyless))
        drop(blocks, skip, keyless)
    index.drop = spied
    return calls


def fill_and_evict(m: KVCacheManager) -> list[int]:
    """A miss of 8 blocks (a keyed first block heading a pending run of 7), freed, then
    another miss of 8 blocks that evicts all of them (the pool holds 8), the run first
    (its tail first, as freed); the hashes announced removed."""
    m.add_request("a", list(range(8 * BS)))
    m.free("a")
    m.take_events()
    m.add_request("b", list(range(1000, 1000 + 8 * BS)))
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    m.check_invariants()
    return [h for e in removed for h in e.block_hashes]


def test_without_a_tier_an_eviction_skips_pending_blocks_by_spans_alone():
    m = KVCacheManager(8, BS, enable_events=True)
    calls = spy(m)
    gone = fill_and_evict(m)
    (skip, keyless), = calls
    assert keyless is None  # (no tier below: no record built)
    assert skip == [(0, 7)]  # (the run's 7 blocks; the first block, keyed, unkeyed)
    assert len(gone) == 8  # (each evicted content announced, the pending ones too)
    m.free("b")  # (the first prompt's content gone, the second's found)
    assert m.lookup(list(range(8 * BS))) == 0
    assert m.lookup(list(range(1000, 1000 + 8 * BS))) == 8 * BS - 1 - (8 * BS - 1) % BS
    m.check_invariants()


def test_with_a_tier_below_the_records_are_kept_for_it():
    m = KVCacheManager(8, BS, enable_events=True)
    m._index.run_counts.spans = True  # (as a tier below sets it: ``ContentChains``)
    calls = spy(m)
    fill_and_evict(m)
    (skip, keyless), = calls
    assert isinstance(keyless, Keyless)
    assert [(lo, hi) for lo, hi, *_ in keyless.spans] == skip
