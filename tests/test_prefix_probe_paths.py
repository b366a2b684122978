"""``PrefixProbe`` (groups/cached.py) beyond tests/test_block_probe.py's random streams:
``copies`` (a group past the groups: none; nothing found: none), and a probe asked
deepest first after its last prefix's full-attention block was evicted and the prompt
computed again. Full attention beside a window of 8, block size 4, a 16-token prompt;
each answer is a fresh probe's."""

from prefixkv.groups import HybridKVCacheManager, full_attention, sliding_window

BS = 4
P = list(range(16))


def _manager():
    return HybridKVCacheManager([full_attention(), sliding_window(2 * BS)], 10, BS)


def _found_then_freed():
    """"a" computed P, a probe found its prefixes, "a" freed: (manager, probe)."""
    m = _manager()
    probe = m.prefix_probe(P)
    m.add_request("a", P)
    assert [probe.ids(n) for n in (4, 8, 12, 16)] == [(1, 5), (2, 6), (3, 7), (4, 8)]
    m.free("a")
    return m, probe


def test_copies_per_group_and_none_past_the_groups_or_for_nothing_found():
    m = _manager()
    probe = m.prefix_probe(P)
    assert probe.copies(16, 0) == probe.copies(16, 2) == ()        # nothing holds it yet
    m.add_request("a", P)
    assert m.get_block_ids("a") == ((1, 2, 3, 4), (5, 6, 7, 8))
    assert (probe.copies(16, 0), probe.copies(16, 1), probe.copies(8, 1)) == ((4,), (8,), (6,))
    assert probe.copies(16, 2) == probe.copies(16, 5) == ()
    assert m.prefix_probe([*P[:8], 99, 99, 99, 99]).copies(12, 0) == ()


def test_a_probe_asked_deepest_first_after_its_last_block_went_finds_the_new_one():
    m, probe = _found_then_freed()
    m.add_request("c", [90] * 4)          # the empty block 9, then a's full block 4
    m.free("c")
    m.add_request("a2", P)                # computes the last block again
    want = [m.prefix_probe(P).ids(n) for n in (16, 12, 8, 4)]
    assert want[0] == (8, 5)
    assert [probe.ids(n) for n in (16, 12, 8, 4)] == want


def test_a_probe_asked_deepest_first_after_its_last_two_prefixes_left_walks_from_the_one_before():
    m, probe = _found_then_freed()
    m.add_request("c", [90] * 8)          # a's blocks of 12 and 16 (full and window)
    m.free("c")
    m.add_request("a2", P)
    want = [m.prefix_probe(P).ids(n) for n in (16, 12, 8, 4)]
    assert want[:2] == [(4, 9), (7, 3)]
    assert [probe.ids(n) for n in (16, 12, 8, 4)] == want
