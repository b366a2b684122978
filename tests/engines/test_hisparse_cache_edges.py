"""Edges of HiSparse prefix caching on the state (``groups.hisparse.cache``) and of its
imports' bookkeeping (``groups.hisparse.imports``) that the side-by-side tests against
vLLM do not reach, because vLLM's manager always asks for caching before a step: a
request the caller never asks to cache, a hit whose copies are confirmed before its
first caching wish, a hit asked with no pages, and the imports' own invariants. Exact
values; needs no vLLM (mutants-r29)."""

from __future__ import annotations

import pytest

from prefixkv.errors import InvariantError, RequestError
from prefixkv.groups.hisparse.cache import HiSparseCache
from prefixkv.groups.hisparse.imports import Imports

BS = 4
HASHES = [bytes([i]) * 4 for i in range(8)]


def _cache() -> HiSparseCache:
    # 32 device blocks, 32 host blocks, a 1-block hot region, a window of 8 pages, 16 pages
    return HiSparseCache(32, 32, 1, BS, 8, 16)


def _confirm_all(s: HiSparseCache) -> list[int]:
    sent = [tid for tid, _, _ in s.take_copies()]
    return s.report(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))


def _published(s: HiSparseCache) -> tuple[int, int]:
    host, indexer = s.lookup(HASHES, 32)
    return len(host), len(indexer)


def test_a_request_never_cached_steps_confirms_and_goes_publishing_nothing() -> None:
    s = _cache()
    assert s.allocate("a", 16)
    s.advance("a", 16)
    assert _confirm_all(s) == [0, 1, 2, 3]
    s.advance("a", 16)  # (a second step: nothing to adopt, no wish)
    s.check_invariants()
    s.free("a", finished=True)
    s.check_invariants()
    assert _published(s) == (0, 0) and s.copies == {}
    assert (s.device.num_free, s.host.num_free) == (31, 31)


def _hit(s: HiSparseCache) -> tuple[int, int]:
    """Request "a" computes 4 pages, is cached and confirmed, and goes: 4 pages published."""
    assert s.allocate("a", 16)
    s.cache("a", 16, HASHES)
    s.advance("a", 16)
    _confirm_all(s)
    s.free("a", finished=True)
    return _published(s)


def test_a_hits_copies_confirmed_before_its_first_wish_publish_nothing_more() -> None:
    s = _cache()
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("b", 24, HASHES, host, indexer)
    s.advance("b", 24)
    assert _confirm_all(s) == [4, 5]  # (pages 4 and 5, past the hit; no wish yet)
    s.check_invariants()
    assert _published(s) == (4, 4)
    s.cache("b", 24, HASHES)
    assert _published(s) == (6, 6)


def test_a_hit_of_no_page_is_refused_with_nothing_changed() -> None:
    s = _cache()
    free = (s.device.num_free, s.host.num_free)
    with pytest.raises(RequestError):
        s.admit("b", 8, HASHES, [], [])
    assert not s.holds("b") and (s.device.num_free, s.host.num_free) == free
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    with pytest.raises(RequestError):  # (a host hit shorter than the indexer's)
        s.admit("b", 24, HASHES, host[:2], indexer)
    assert s.admit("b", 24, HASHES, host, indexer)
    with pytest.raises(RequestError):  # (a request held already)
        s.admit("b", 24, HASHES, host, indexer)


def test_the_imports_invariants_name_a_restore_not_in_flight_and_an_import_of_a_request_gone() -> None:
    imports = Imports()
    imports.restores[3] = True
    imports.pending["a"] = 8
    imports.check_invariants([3], ["a"])
    with pytest.raises(InvariantError, match=r"restores \[3\] not all in flight"):
        imports.check_invariants([], ["a"])
    with pytest.raises(InvariantError, match="imports pending for requests gone"):
        imports.check_invariants([3], [])
    imports.pending.clear()
    imports.failed["b"] = 4
    with pytest.raises(InvariantError, match="imports pending for requests gone"):
        imports.check_invariants([3], ["a"])


def _copies(s: HiSparseCache) -> list[int]:
    return [s.copies[h].block_id for h in HASHES[:4]]


def test_the_last_request_to_publish_a_page_holds_its_copy_until_its_own_pages_go() -> None:
    """Two requests compute the same 4 pages; each publishes them as its copies are
    confirmed, the later one's copies indexed (vLLM's ``_record_copy`` replaces). A
    further publication of the first (its fifth page) records that page's copy alone; the
    first freed and its blocks reused, the second's copies stay indexed."""
    s = _cache()
    for key in ("a", "b"):
        assert s.allocate(key, 16)
    a_row, b_row = s.request("a")[2], s.request("b")[2]
    for key in ("a", "b"):
        s.cache(key, 16, HASHES)
        s.advance(key, 16)
        _confirm_all(s)
        assert _copies(s) == (a_row if key == "a" else b_row)
    assert s.allocate("a", 20)
    s.cache("a", 20, HASHES)
    s.advance("a", 20)
    _confirm_all(s)
    s.check_invariants()
    assert _copies(s) == b_row and s.copies[HASHES[4]].block_id == s.request("a")[2][4]
    s.free("a", finished=True)  # (its blocks reused: b's copies stay indexed, a's fifth goes)
    taken = s.device.take(s.device.num_free)
    assert _copies(s) == b_row and HASHES[4] not in s.copies
    s.check_invariants(taken)


def test_a_hit_adopts_copies_at_its_first_step_only() -> None:
    """A hit whose copies were lost before its first step reads its hit pages from host;
    copies of those pages published later by another request are not adopted at its
    later steps (vLLM adopts at the first step alone)."""
    s = _cache()
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("b", 20, HASHES, host, indexer)
    taken = s.device.take(s.device.num_free)  # (another user: the free copies are reused)
    assert s.copies == {}
    s.device.free(taken)
    s.advance("b", 20)
    assert s.request("b")[2][:4] == [0, 0, 0, 0]
    assert s.allocate("c", 16)
    s.cache("c", 16, HASHES)
    s.advance("c", 16)
    _confirm_all(s)
    assert _copies(s) == s.request("c")[2][:4]
    s.advance("b", 20)
    s.check_invariants()
    assert s.request("b")[2][:4] == [0, 0, 0, 0]


def test_the_cache_checks_include_the_states() -> None:
    """A device block taken behind the state's back is named by its checks (the pools'
    counts, ``HiSparseState.check_invariants``), and passes when it is declared."""
    s = _cache()
    assert _hit(s) == (4, 4)
    taken = s.device.take(1)
    with pytest.raises(InvariantError):
        s.check_invariants()
    s.check_invariants(taken)


def test_a_finished_request_whose_wish_is_published_holds_back_no_host_block() -> None:
    """Its wish (2 pages) published, a request finished with the copies of pages 2 and 3
    in flight keeps only their host blocks (orphans), none for a publication (vLLM's
    ``free`` detaches only a pending publication); they come back when confirmed."""
    s = _cache()
    assert s.allocate("a", 16)
    s.cache("a", 8, HASHES)
    s.advance("a", 16)
    sent = [tid for tid, _, _ in s.take_copies()]
    assert sent == [0, 1, 2, 3]
    assert s.report({0: 1, 1: 1}, {0: 1, 1: 1}) == [0, 1]
    assert _published(s) == (2, 2)
    s.free("a", finished=True)
    s.check_invariants()
    assert s.host.num_free == 29
    assert s.report({2: 1, 3: 1}, {2: 1, 3: 1}) == [2, 3]
    assert s.host.num_free == 31 and _published(s) == (2, 2)


def test_the_cache_checks_name_a_copy_no_one_reads() -> None:
    s = _cache()
    assert _hit(s) == (4, 4)
    s.check_invariants()
    s._copy_of.clear()  # (a copy whose block is no longer named its copy)
    with pytest.raises(InvariantError, match="is neither read nor unpinned"):
        s.check_invariants()


def test_an_adopted_copy_reused_by_another_user_is_read_from_host() -> None:
    """A hit adopts the 4 copies (blocks 5-8) at its first step and, its row reading from
    host, unpins pages 0-2 again; another user taking every free block reuses those
    three: the row reads them from host (0), never a block another user writes."""
    s = _cache()
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("b", 20, HASHES, host, indexer)
    s.advance("b", 20)
    assert s.request("b")[2] == [5, 6, 7, 8, 10]
    taken = s.device.take(s.device.num_free)
    assert {5, 6, 7} <= {b.block_id for b in taken}
    assert s.request("b")[2] == [0, 0, 0, 8, 10]
    assert s.take_residency("b") == ([0, 1, 2, 3, 4], [0, 0, 0, 8, 10])
    s.check_invariants(taken)


def test_a_copy_adopted_after_the_workers_were_told_is_told_them() -> None:
    """The workers told the hit's row (its hit pages read from host) before its first
    step; the copies adopted then are told at the next ``take_residency``."""
    s = _cache()
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("b", 20, HASHES, host, indexer)
    assert s.take_residency("b") == ([0, 1, 2, 3, 4], [0, 0, 0, 0, 10])
    s.advance("b", 20)
    assert s.take_residency("b") == ([0, 1, 2, 3], [5, 6, 7, 8])


def test_an_eviction_naming_a_block_out_of_range_is_refused_with_nothing_changed() -> None:
    s = _cache()
    assert _hit(s) == (4, 4)
    for pool in ("host", "device"):
        with pytest.raises(RequestError):
            s.evict([1, 32], pool)
        assert _published(s) == (4, 4)
    s.evict([1], "device")
    assert _published(s) == (4, 0)


def test_a_hit_short_of_device_blocks_is_not_admitted_with_nothing_changed() -> None:
    s = _cache()
    assert _hit(s) == (4, 4)
    host, indexer = s.lookup(HASHES, 32)
    need = s.need_hit(20, host, indexer)
    taken = s.device.take(s.device.num_free - need + 1)
    before = (s.device.free_order(), s.host.free_order())
    assert not s.admit("b", 20, HASHES, host, indexer)
    assert not s.holds("b") and (s.device.free_order(), s.host.free_order()) == before
    s.device.free(taken[-1:])
    assert s.admit("b", 20, HASHES, host, indexer)
    s.check_invariants(taken[:-1])


def test_the_cache_checks_name_a_request_block_holding_another_hash() -> None:
    s = _cache()
    assert s.allocate("a", 16)
    s.cache("a", 16, HASHES)
    s.check_invariants()
    s._pubs["a"].hashes = HASHES[::-1]  # (the request's hashes, not its blocks')
    with pytest.raises(InvariantError, match="'a''s indexer blocks hold other hashes"):
        s.check_invariants()


def test_published_pages_evicted_for_another_request_are_found_no_more() -> None:
    """A 6-block host pool: "a"'s 4 published pages (host blocks 1-4) freed, "c" takes 4
    host blocks, 3 of them evicted from the published ones (blocks 4, 3, 2: the tail
    first); the hit is page 0 alone, never a page whose host block "c" writes."""
    s = HiSparseCache(32, 6, 1, BS, 8, 16)
    assert s.allocate("a", 16)
    s.cache("a", 16, HASHES)
    s.advance("a", 16)
    _confirm_all(s)
    s.free("a", finished=True)
    assert _published(s) == (4, 4)
    assert s.allocate("c", 16)
    assert s.request("c")[0] == [5, 4, 3, 2]
    host, indexer = s.lookup(HASHES, 32)
    assert [b.block_id for b in host] == [1] and len(indexer) == 1
    s.check_invariants()


def test_the_hash_index_names_several_blocks_per_hash_and_forgets_them() -> None:
    from prefixkv.core.block import Block
    from prefixkv.groups.hisparse.hash_index import HashIndex

    index = HashIndex()
    blocks = [Block(i) for i in range(4)]
    for b in blocks:
        b.refs = 1
    index.record(blocks[1], b"h", 0)
    index.record(blocks[2], b"h", 0)
    index.record(blocks[3], b"k", 1)
    assert index.find(b"h") is blocks[1] and len(index) == 2
    assert [index.page_of(b) for b in blocks] == [None, 0, 0, 1]
    assert index.check(blocks) is None
    index.drop([blocks[0], blocks[1]])  # (a block holding no hash: nothing)
    assert index.find(b"h") is blocks[2] and blocks[1].key is None and index.page_of(blocks[1]) is None
    blocks[0].key = b"k"  # (a hash the index does not name it under)
    assert index.check(blocks) == "block 0 holds b'k', the index names it None"
    blocks[0].key = None
    index.drop_one(blocks[2])
    assert index.find(b"h") is None and len(index) == 1 and index._pages == {3: 1}
    index.clear()
    assert index.find(b"k") is None and len(index) == 0 and index._pages == {}
