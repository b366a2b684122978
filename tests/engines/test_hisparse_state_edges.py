"""Edges of the HiSparse state (``groups.hisparse.state``, ``state_check``) that its
side-by-side streams do not reach: a copy two live hits read, one of them freed before
another user reuses it, and the state's checks naming an import of a request gone.
Exact values; needs no vLLM (mutants-r30)."""

from __future__ import annotations

import pytest

from prefixkv.errors import InvariantError
from prefixkv.groups.hisparse.cache import HiSparseCache

from .test_hisparse_cache_edges import HASHES, _cache, _hit


def _b_goes_and_c_reads_5_to_7_from_host_once_reused(s: HiSparseCache, last: int) -> None:
    """"b" freed, "c" alone reads blocks 5-7 (its pages 0-2, unpinned); another user takes
    every free block: c's row reads those pages from host (0), told at ``take_residency``
    (``last``: c's last page's block)."""
    s.free("b", finished=True)
    assert {b: sorted(readers) for b, readers in s._unpinned.items()} == {
        5: [("c", 0)], 6: [("c", 1)], 7: [("c", 2)]}
    s.check_invariants()
    taken = s.device.take(s.device.num_free)
    assert {5, 6, 7} <= {b.block_id for b in taken}
    assert s.request("c")[2] == [0, 0, 0, 8, last]
    assert s.take_residency("c") == ([0, 1, 2, 3, 4], [0, 0, 0, 8, last])
    s.check_invariants(taken)


def test_a_copy_two_hits_unpinned_is_read_from_host_by_the_one_left_once_reused() -> None:
    """"b" and "c" both adopt the copies of "a"'s 4 published pages (blocks 5-8) and,
    reading from host, unpin pages 0-2: each of blocks 5-7 has two readers. "b" goes; another
    user taking every free block reuses 5-7: "c" reads those pages from host from then on
    (its row 0 there, told at the next ``take_residency``), never a block another user writes."""
    s = _cache()
    assert _hit(s) == (4, 4)
    for key in ("b", "c"):
        host, indexer = s.lookup(HASHES, 32)
        assert s.admit(key, 20, HASHES, host, indexer)
        s.advance(key, 20)
    assert s.request("c")[2] == [5, 6, 7, 8, 13]
    assert {b: sorted(readers) for b, readers in s._unpinned.items()} == {
        5: [("b", 0), ("c", 0)], 6: [("b", 1), ("c", 1)], 7: [("b", 2), ("c", 2)]}
    _b_goes_and_c_reads_5_to_7_from_host_once_reused(s, 13)


def test_the_state_checks_name_an_import_of_a_request_gone() -> None:
    """``check_invariants`` runs the imports' own checks: a pending import whose request
    the state does not hold is named."""
    s = _cache()
    assert s.allocate("a", 16)
    s.check_invariants()
    s.imports.pending["gone"] = 8
    with pytest.raises(InvariantError, match="imports pending for requests gone"):
        s.check_invariants()


def test_a_copy_replaced_then_its_writer_freed_is_still_told_to_its_reader_when_reused() -> None:
    """"b" and "d" compute the same 4 pages; b's copies (device blocks 5-8) are confirmed
    first and published, "c" hits them, adopts 5-8 and, reading from host, unpins pages
    0-2 (blocks 5-7 read by c alone, held by b). d's copies confirmed, d's blocks (13-16)
    become the pages' GPU copies. b goes: 5-7 are unpinned, no longer copies, still read by
    c; another user taking every free block reuses them, and c reads those pages from host
    (0), never a block another user writes. (mutants-r30: b's blocks let go while c reads
    them, as a block no one reads.)"""
    s = _cache()
    for key in ("b", "d"):
        assert s.allocate(key, 16)
        s.cache(key, 16, HASHES)
        s.advance(key, 16)
    sent = [tid for tid, _, _ in s.take_copies()]
    assert s.report(dict.fromkeys(sent[:4], 1), dict.fromkeys(sent[:4], 1)) == [0, 1, 2, 3]
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("c", 20, HASHES, host, indexer)
    s.advance("c", 20)
    assert s.request("c")[2] == [5, 6, 7, 8, 18]
    assert s.report(dict.fromkeys(sent[4:], 1), dict.fromkeys(sent[4:], 1)) == [4, 5, 6, 7]
    assert sorted(b.block_id for b in s.copies.values()) == [13, 14, 15, 16]
    _b_goes_and_c_reads_5_to_7_from_host_once_reused(s, 18)


def test_a_page_confirmed_past_a_restore_in_flight_is_published_with_it() -> None:
    """A load of 12 tokens (3 whole pages) with 8 new ones: done, cached to 20 tokens, the
    whole last page's restore (copy 0) in flight: 3 pages published. The step's copies of
    pages 3 and 4 planned; page 3's confirmed first, the restore still in flight: 4 pages
    published (the valid prefix goes on past the restored page); the rest confirmed, 5.
    (mutants-r30: the walk past the restored page not moving: a loop.)"""
    s = _cache()
    assert s.load("L", 12, 20)
    s.finish_import("L", failed=False)
    s.cache("L", 20, HASHES)
    assert [len(found) for found in s.lookup(HASHES, 32)] == [3, 3]
    s.advance("L", 20)
    assert s.take_copies() == [(0, 4, 3), (1, 7, 4), (2, 8, 5)]
    assert s.report({1: 1}, {1: 1}) == [1]
    assert [len(found) for found in s.lookup(HASHES, 32)] == [4, 4]
    assert s.report({0: 1, 2: 1}, {0: 1, 2: 1}) == [0, 2]
    assert [len(found) for found in s.lookup(HASHES, 32)] == [5, 5]
    s.check_invariants()


@pytest.mark.parametrize(("pool", "hit"), [("host", ([1], [1])), ("device", ([1, 2, 3, 4], [1]))])
def test_a_hit_stops_at_the_first_page_evicted(pool: str, hit: tuple[list[int], list[int]]) -> None:
    """"a"'s 4 pages published (host and indexer blocks 1-4), then block 2 (page 1) of one
    pool evicted: the host hit, or the indexer's (the hit's length), stops at page 0, never
    pages 2 and 3 read as pages 1 and 2 (a wrong KV). (mutants-r30: the lookup going on
    past a page it does not find.)"""
    s = _cache()
    assert _hit(s) == (4, 4)
    s.evict([2], pool)
    host, indexer = s.lookup(HASHES, 32)
    assert ([b.block_id for b in host], [b.block_id for b in indexer]) == hit
    s.check_invariants()


def test_a_hit_adopts_the_copies_that_survive_past_a_page_whose_copy_is_lost() -> None:
    """"a" publishes 4 pages (copies 5-8), "c" the first 2 again (its copies 11-12 take
    their place). c freed and its blocks reused by another user: pages 0-1 have no GPU
    copy left, pages 2-3 keep a's. a freed; "b" hits the 4 pages and at its first step
    adopts 7 and 8 for pages 2-3, reading 0-1 from host. (mutants-r30: the adoption
    stopping at the first page without a copy.)"""
    s = _cache()
    for key, tokens in (("a", 16), ("c", 8)):
        assert s.allocate(key, tokens)
        s.cache(key, tokens, HASHES)
        s.advance(key, tokens)
        sent = [tid for tid, _, _ in s.take_copies()]
        s.report(dict.fromkeys(sent, 1), dict.fromkeys(sent, 1))
    assert sorted(b.block_id for b in s.copies.values()) == [7, 8, 11, 12]
    s.free("c", finished=True)
    s.device.free(s.device.take(s.device.num_free))  # (another user's, given back)
    assert sorted(b.block_id for b in s.copies.values()) == [7, 8]
    s.free("a", finished=True)
    host, indexer = s.lookup(HASHES, 32)
    assert s.admit("b", 20, HASHES, host, indexer)
    s.advance("b", 20)
    assert s.request("b")[2] == [0, 0, 7, 8, 14]
    s.check_invariants()


def test_a_hit_shorter_on_the_indexer_takes_the_host_blocks_of_its_own_pages_only() -> None:
    """"a"'s 4 pages published, then the indexer's page 3 (block 4) evicted: the lookup
    answers 4 host blocks and 3 indexer blocks; "b" admitted with them reads host blocks
    1-3 and takes new ones (5, 6) for pages 3-4, never host block 4 of the longer host
    hit. The last block of each pool may be named in an eviction (it holds nothing here).
    (mutants-r30: the host blocks cut one past the hit; the eviction's bound.)"""
    s = _cache()
    assert _hit(s) == (4, 4)
    s.evict([4], "device")
    host, indexer = s.lookup(HASHES, 32)
    assert ([b.block_id for b in host], [b.block_id for b in indexer]) == ([1, 2, 3, 4], [1, 2, 3])
    assert s.admit("b", 20, HASHES, host, indexer)
    assert s.request("b")[:3] == ([1, 2, 3, 5, 6], [1, 2, 3, 4, 9], [0, 0, 0, 10, 11])
    s.evict([31], "device")
    s.evict([31], "host")
    s.check_invariants()
