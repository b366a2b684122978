"""A block whose content is forgotten (``uncache_blocks``, ``rewind``, ``free(...,
num_computed_tokens=...)``) takes its cached descendants with it: each is withdrawn
(``BlockRemoved``) and, if free, goes empty. Before, they stayed indexed and announced
under the lost content id; once that content was recomputed (a new content id, the same
chain hash) the event stream claimed them while ``lookup`` could not reach them, and with
a host tier ``check_invariants`` failed."""

from __future__ import annotations

import pytest

from prefixkv import KVCacheManager
from prefixkv.hashing import chain, encode_tokens, token_bytes
from test_index import Mirror

BS = 4
PROMPT = list(range(13))  # three full blocks


def _hashes(mirror: Mirror, prompt: list[int]) -> list[bytes]:
    """The chain hashes of ``prompt``'s full blocks."""
    n = len(prompt) // BS
    return chain(mirror.fn, mirror.root, token_bytes(encode_tokens(prompt[:n * BS])), [b""] * n)[0]


def _announced(mirror: Mirror, prompt: list[int]) -> list[bool]:
    """Per full block of ``prompt``: whether the events say a block holds it."""
    mirror.drain()
    return [h in mirror.count for h in _hashes(mirror, prompt)]


def _predicted(mirror: Mirror, prompt: list[int]) -> int:
    """The tokens of ``prompt`` the events say an admission hits now."""
    mirror.drain()
    return mirror.predict(prompt)


def _cached_prompt(m: KVCacheManager) -> tuple[int, ...]:
    """PROMPT computed by a request that went: its block ids."""
    m.add_request("gone", PROMPT)
    ids = m.get_block_ids("gone")
    m.free("gone")
    return ids


@pytest.mark.parametrize("how", ["rewind", "uncache_blocks"])
def test_a_hit_forgotten_and_recomputed_does_not_leave_its_cached_children_announced(how):
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True)
    mirror = Mirror(m, "sha256", None)
    ids = _cached_prompt(m)
    assert _announced(mirror, PROMPT) == [True] * 3
    m.add_request("a", PROMPT[:4] + [99])  # hits block 0 alone
    assert m.get_block_ids("a")[0] == ids[0]
    if how == "uncache_blocks":  # a load into it failed
        m.uncache_blocks([ids[0]])
    m.rewind("a", 0)
    assert _announced(mirror, PROMPT) == [False] * 3  # before: blocks 1 and 2 still
    m.check_invariants()
    # the freed children went empty: the next blocks taken are theirs, not cached ones
    assert set(m.free_block_order()[:2]) == {ids[1], ids[2]}
    assert m.extend("a", 5) == ()  # block 0 recomputed: a new content id, the same hash
    m.check_invariants()
    assert m.lookup(PROMPT) == 4
    assert _predicted(mirror, PROMPT) == 4  # before: 12
    m.free("a")
    assert m.add_request("b", PROMPT).num_cached_tokens == 4
    m.check_invariants()


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_an_abort_that_forgets_a_block_another_request_built_on_takes_that_child_too(host_blocks):
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True, host_blocks=host_blocks)
    mirror = Mirror(m, "sha256", None)
    m.add_request("a", PROMPT[:9])  # blocks 0 and 1, computed in this step
    m.add_request("b", PROMPT)  # hits them in the same step; computes block 2 on top
    assert m.get_block_ids("b")[:2] == m.get_block_ids("a")[:2]
    m.free("b")
    m.free("a", num_computed_tokens=0)  # a's step never ran: blocks 0 and 1 never computed
    # before, with a host tier: InvariantError, block 2 is found but its parent's content
    # is not on the device
    m.check_invariants()
    assert _announced(mirror, PROMPT) == [False] * 3  # before: block 2 still
    m.add_request("c", PROMPT[:8] + [7])  # computes blocks 0 and 1 again
    m.check_invariants()
    assert m.lookup(PROMPT) == 8
    assert _predicted(mirror, PROMPT) == 8  # before: 12 (b's block 2 announced under them)


def test_descendants_of_descendants_go_too_keyed_or_chained():
    # gone2's block 1 (a sibling of gone's) is keyed; each one's child is chained
    m = KVCacheManager(24, BS, hash_mode="sha256", enable_events=True)
    mirror = Mirror(m, "sha256", None)
    _cached_prompt(m)
    other = PROMPT[:4] + [50, 51, 52, 53, 54, 55, 56, 57, 58]
    m.add_request("gone2", other)
    m.free("gone2")
    m.add_request("a", PROMPT[:4] + [99])
    m.rewind("a", 0)
    m.check_invariants()
    assert m.num_cached_blocks == 0
    mirror.drain()
    assert mirror.count == {}  # before: four blocks announced under the lost block 0
    m.extend("a", 5)
    assert _predicted(mirror, PROMPT) == m.lookup(PROMPT) == 4
    assert _predicted(mirror, other) == m.lookup(other) == 4
    m.check_invariants()


def test_host_slots_recorded_under_a_forgotten_device_content_go_too():
    m = KVCacheManager(5, BS, hash_mode="sha256", enable_events=True, host_blocks=6)
    mirror = Mirror(m, "sha256", None)
    ids = _cached_prompt(m)
    m.take_kv_ops()  # (a later step: its evictions offload)
    m.add_request("f", list(range(100, 113)))  # evicts blocks 2 and 1: host slots
    assert m.take_kv_ops()[0].src == (ids[2], ids[1])
    m.free("f")
    assert _announced(mirror, PROMPT) == [True] * 3  # block 0 on the device, 1 and 2 host
    m.add_request("a", PROMPT[:4] + [99])  # hits block 0 alone
    m.rewind("a", 0)
    m.check_invariants()
    assert _announced(mirror, PROMPT) == [False] * 3  # before: the slots of 1 and 2 still
    m.extend("a", 5)  # block 0 recomputed: a new content id, the same hash
    m.take_kv_ops()
    m.check_invariants()
    assert _predicted(mirror, PROMPT) == m.lookup(PROMPT) == 4  # before: events 12
    m.free("a")
    m.check_invariants()


@pytest.mark.parametrize("pending", [False, True])
def test_host_slots_offloaded_into_in_the_same_step_go_empty_once_unpinned(pending):
    m = KVCacheManager(5, BS, hash_mode="sha256", enable_events=True, host_blocks=6)
    mirror = Mirror(m, "sha256", None)
    ids = _cached_prompt(m)
    m.take_kv_ops()
    m.add_request("a", PROMPT[:4] + [99])  # hits block 0 alone
    m.add_request("f", list(range(100, 109)))  # evicts blocks 2 and 1 into slots, pinned
    m.rewind("a", 0)  # (before the plan is taken: the slots are pinned still)
    m.check_invariants()
    assert _announced(mirror, PROMPT) == [False] * 3
    ops = m.take_kv_ops(pending=pending)
    assert ops[0].src == (ids[2], ids[1])  # (the engine still copies them: harmless)
    if pending:
        m.check_invariants()
        m.kv_ops_done()
    m.check_invariants()
    m.extend("a", 5)
    m.take_kv_ops()
    m.check_invariants()
    assert _predicted(mirror, PROMPT) == m.lookup(PROMPT) == 4
    m.free("a")
    m.free("f")
    m.check_invariants()
    assert m.lookup(PROMPT) == 4


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_blocks_a_request_fills_after_its_block_was_uncached_are_not_announced(host_blocks):
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True, host_blocks=host_blocks)
    mirror = Mirror(m, "sha256", None)
    m.add_request("a", PROMPT[:9])
    m.uncache_blocks([m.get_block_ids("a")[1]])  # a load into block 1 failed; a goes on
    m.append_tokens("a", PROMPT[9:13])  # block 2 fills, computed on top of the invalid KV
    m.take_kv_ops()
    m.check_invariants()
    assert _announced(mirror, PROMPT) == [True, False, False]  # before: block 2 announced
    m.free("a")
    m.add_request("c", PROMPT[:8] + [77])  # computes block 1 again (a new content id)
    m.take_kv_ops()
    m.check_invariants()
    assert _predicted(mirror, PROMPT) == m.lookup(PROMPT) == 8  # before: events 12


def test_with_a_host_tier_no_hit_reads_a_block_computed_on_top_of_a_failed_load():
    m = KVCacheManager(6, BS, hash_mode="sha256", host_blocks=6)
    m.add_request("gone", PROMPT[:9])
    m.free("gone")
    m.take_kv_ops()
    m.add_request("f", list(range(100, 121)))  # evicts gone's blocks 1 and 0: host slots
    m.take_kv_ops()
    m.free("f")
    assert m.add_request("a", PROMPT[:9]).num_cached_tokens == 8  # loads both slots
    a = m.get_block_ids("a")
    m.take_kv_ops()
    m.uncache_blocks([a[1]])  # the load into block 1 failed; a goes on
    m.append_tokens("a", PROMPT[9:13])  # block 2: its KV read block 1's invalid KV
    m.take_kv_ops()
    m.check_invariants()
    # block 1's content is still in its slot; block 2 must not be found after it
    assert m.lookup(PROMPT) == 8  # before: 12
    m.free("a")
    adm = m.add_request("b", PROMPT)
    assert adm.num_cached_tokens == 8  # before: 12, a hit on a's block 2
    m.check_invariants()


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_the_blocks_a_request_computed_after_a_failed_spare_go_with_it(host_blocks):
    # as the groups' test_the_blocks_a_request_computed_after_a_block_that_failed_to_load_
    # go_with_it: b's block 0 is a spare of a's (the content stays found through a's); b's
    # block 1, recorded before the failure and computed on it, stayed found
    m = KVCacheManager(16, BS, hash_mode="sha256", enable_events=True, host_blocks=host_blocks)
    mirror = Mirror(m, "sha256", None)
    m.add_request("a", [1, 2, 3, 4, 0])
    m.add_request("b", [1, 2, 3, 4])  # no hit (the block holding its last token)
    m.append_tokens("b", [0, 5, 6, 7, 8])  # b's block 1
    assert (m.get_block_ids("a"), m.get_block_ids("b")) == ((0, 1), (2, 3, 4))
    m.take_kv_ops()
    m.uncache_blocks([2])  # the load into b's block 0 failed
    m.take_kv_ops()
    m.check_invariants()
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 0]
    assert _announced(mirror, prompt) == [True, False]  # before: [True, True]
    assert _predicted(mirror, prompt) == m.lookup(prompt) == 4  # a's block 0; before: 8
    m.free("b")
    m.take_kv_ops()
    m.check_invariants()
    assert _predicted(mirror, prompt) == m.lookup(prompt) == 4
    assert m.add_request("c", prompt).num_cached_tokens == 4  # before: 8, b's block 1
    m.check_invariants()


@pytest.mark.parametrize("host_blocks", [0, 6])
def test_a_request_that_hit_a_block_computed_on_a_failed_spare_loses_its_later_blocks(host_blocks):
    # c hit b's block 1 (computed on b's failed spare) and computed its block 2 on it; d's
    # block 1 (computed on a's sound block 0) keeps that content found: c's block 2 stayed
    m = KVCacheManager(32, BS, hash_mode="sha256", enable_events=True, host_blocks=host_blocks)
    mirror = Mirror(m, "sha256", None)
    m.add_request("a", [1, 2, 3, 4, 0])
    m.add_request("b", [1, 2, 3, 4])  # no hit: b's block 0 is a spare of a's
    m.append_tokens("b", [0, 5, 6, 7, 8])  # b's block 1
    assert m.add_request("c", [1, 2, 3, 4, 0, 5, 6, 7, 9, 9, 9, 9, 1]).num_cached_tokens == 8
    m.add_request("d", [1, 2, 3, 4, 0, 5, 6, 7])  # its block 1: a spare of b's, sound
    assert [m.get_block_ids(r) for r in "abcd"] == [(0, 1), (2, 3, 4), (0, 3, 5, 6), (0, 7)]
    m.take_kv_ops()
    m.uncache_blocks([2])  # the load into b's block 0 failed
    m.take_kv_ops()
    m.check_invariants()
    prompt = [1, 2, 3, 4, 0, 5, 6, 7, 9, 9, 9, 9, 0]
    assert _announced(mirror, prompt) == [True, True, False]  # before: c's block 2 too
    assert _predicted(mirror, prompt) == m.lookup(prompt) == 8  # d's block 1; before: 12
    m.free("b")
    m.free("c")
    m.take_kv_ops()
    m.check_invariants()
    assert m.add_request("e", prompt).num_cached_tokens == 8  # before: 12, c's block 2
    m.check_invariants()
