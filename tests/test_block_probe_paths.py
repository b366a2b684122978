"""``BlockProbe``'s other paths (core/probe.py), beside tests/test_block_probe.py's
random streams on a plain manager:
- a manager with a host tier, where every question is ``match``'s whole walk;
- a manager with caching off;
- ``copies`` (the block, then its spares; another group's: none);
- a ``num_tokens`` off the block grid, refused;
- a walk that goes on from a prefix whose every block it found before was evicted.

Each answer is held to ``lookup_block_ids`` (``_truth``) as in test_block_probe."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import ExtraKeys, KVCacheManager, MultiModalInput, RequestError
from test_block_probe import BS, OPS, PROMPTS, _drive, _sizes, _truth


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(4, 12), host_blocks=st.integers(1, 8), ops=OPS)
def test_a_probe_beside_a_host_tier_answers_as_a_fresh_walk(num_blocks, host_blocks, ops):
    m = KVCacheManager(num_blocks, BS, host_blocks=host_blocks)
    probes = [m.block_probe(p) for p in PROMPTS]

    def check(serial: int) -> None:
        m.take_kv_ops()
        for p, probe in zip(PROMPTS, probes, strict=True):
            for n in _sizes(p):
                at = probe.at(n)
                assert at == _truth(m, p, n), (serial, p, n)
                assert probe.copies(n)[:1] == (() if at is None else (at,))

    _drive(m, ops, check)


def test_a_probe_without_caching_finds_nothing():
    m = KVCacheManager(8, BS, enable_caching=False)
    p = PROMPTS[4]
    probe = m.block_probe(p)
    m.add_request("a", p)
    assert [probe.at(n) for n in _sizes(p)] == [None] * 4
    assert probe.copies(16) == ()


def test_copies_list_the_block_then_its_spares_and_nothing_for_another_group():
    m = KVCacheManager(6, BS)
    p = PROMPTS[4]  # 16 tokens: 4 full blocks
    probe = m.block_probe(p)
    assert probe.copies(16) == ()                       # nothing holds it yet
    m.add_request("a", p)
    assert m.add_request("b", p).block_ids == (0, 1, 2, 4)  # its last block anew: a spare of 3
    assert probe.copies(16) == (3, 4) and probe.copies(12) == (2,)
    assert probe.copies(16, 1) == probe.copies(12, 1) == ()  # (one group: another holds none)


@pytest.mark.parametrize("n", [0, 2, 6, 17, 20])
def test_a_count_off_the_block_grid_or_outside_the_prompt_is_refused(n):
    m = KVCacheManager(6, BS)
    probe = m.block_probe(PROMPTS[4])
    with pytest.raises(RequestError):
        probe.at(n)
    with pytest.raises(RequestError):
        probe.copies(n)


def _found_then_freed(num_blocks):
    """A manager of ``num_blocks`` where "a" computed PROMPTS[4] (16 tokens) in blocks
    0..3, a probe of it that found them, and "a" freed: (manager, prompt, probe)."""
    m = KVCacheManager(num_blocks, BS)
    p = PROMPTS[4]
    probe = m.block_probe(p)
    m.add_request("a", p)
    assert [probe.at(n) for n in _sizes(p)] == [0, 1, 2, 3]
    m.free("a")
    return m, p, probe


def test_a_walk_after_every_block_found_was_evicted_starts_again_from_the_root():
    m, p, probe = _found_then_freed(6)
    for i in range(3):  # (other prompts take every block a left)
        m.add_request(f"c{i}", [90 + i] * 8)
        m.free(f"c{i}")
    assert probe.at(16) is None
    m.add_request("a2", p)                              # the same prefix in other blocks
    assert probe.at(16) == _truth(m, p, 16) == m.get_block_ids("a2")[3]
    assert [probe.at(n) for n in _sizes(p)] == list(m.get_block_ids("a2"))


def test_a_walk_goes_on_from_the_deepest_block_found_that_still_holds_its_prefix():
    m, p, probe = _found_then_freed(5)
    m.add_request("c", [90] * 8)   # the empty block 4, then a's tail block 3
    m.add_request("d", [91] * 4)   # a's block 2
    m.free("c")
    m.free("d")
    m.add_request("a2", p)         # a's blocks 0 and 1 hit; 2 and 3 computed anew
    assert m.get_block_ids("a2") == (0, 1, 3, 4)
    # asked deepest first: the blocks found for 12 and 16 hold other prefixes now
    assert [probe.at(n) for n in (16, 12, 8, 4)] == [4, 3, 1, 0]


def test_a_probe_with_images_walks_past_their_blocks():
    m = KVCacheManager(8, BS)
    p = PROMPTS[4]
    extra = ExtraKeys(mm=(MultiModalInput("img", 2, 8),))   # in blocks 0..2 of 4
    probe = m.block_probe(p, extra=extra)
    m.add_request("a", p, extra=extra)
    assert [probe.at(n) for n in _sizes(p)] == list(m.get_block_ids("a")) == \
        list(m.lookup_block_ids([*p, 0], extra=extra))
    assert m.block_probe(p).at(4) is None                   # (without the image: no hit)
