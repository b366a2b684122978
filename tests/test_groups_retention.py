"""A sliding window's retention (``sliding_window(W, retention=R)``, vLLM's
``prefix_cache_retention_interval``): which blocks the hybrid manager of different block
sizes caches, and what it refuses. tests/test_groups_sizes_machine.py (the Retention
machines) holds it to tests/sized_model.py, itself held to vLLM's manager."""

import pytest

from prefixkv import ConfigError, RequestError
from prefixkv.groups import BlockSizes, GroupSpec, HybridKVCacheManager, full_attention, sliding_window
from prefixkv.groups.events import GroupBlockStored


def _stored_windows(retention, prompt, junction=0, first=None, peek=()):
    """The window blocks (group 1) a full32 + window8@8 manager (hash 8, lcm 32; ``peek``:
    vLLM's EAGLE groups) records for a prompt computed whole."""
    m = HybridKVCacheManager([full_attention(), sliding_window(8, retention=retention)], 100,
                             BlockSizes.of([32, 8], peek=peek), hash_mode="sha256", enable_events=True)
    if first is not None:
        assert m.add_request("first", first) is not None
        m.take_events()
    assert m.add_request("r", prompt, junction=junction) is not None
    return {e.first_block for e in m.take_events() if isinstance(e, GroupBlockStored) and e.group_idx == 1}


def test_an_interval_keeps_the_tails_at_its_segments_and_the_replay_boundary():
    """vLLM's test_hybrid_local_kv_retention_interval_aligns_in_manager: a 128-token
    prompt keeps window blocks 7 and 15 (64-token segments) and 11 (the replay boundary
    127, rounded down to 96); dense (None): one tail per 32 tokens; 0: the replay
    boundary's only."""
    prompt = [i for i in range(16) for _ in range(8)]
    assert _stored_windows(64, prompt) == {7, 11, 15}
    assert _stored_windows(None, prompt) == {3, 7, 11, 15}
    assert _stored_windows(0, prompt) == {11}


def test_a_junction_keeps_its_tail_too():
    """A request told its shared-prefix junction (vLLM's ``shared_prefix_boundary``, 64
    here) keeps the window's tail there as well (block 7); without a retention the
    junction changes nothing."""
    prompt = [i for i in range(16) for _ in range(8)]
    assert _stored_windows(0, prompt, junction=64) == {7, 11}
    assert _stored_windows(None, prompt, junction=64) == {3, 7, 11, 15}


def test_beside_eagle_a_peeking_windows_tails_move_one_block_up():
    """vLLM's EAGLE (the window peeking: ``reachable_block_mask``'s shift): a 128-token
    prompt's replay boundaries are 64 and 96 (one 32-token block below 127's and 128's
    last boundary), each kept with the window's tail (one block) and the block past it:
    7, 8 and 11, 12; a 64-token segment's end adds 15 (16 lies past what the prompt
    caches); a junction at 64 adds the tail one block below it (56, rounded down to 32:
    3, 4)."""
    prompt = [i for i in range(16) for _ in range(8)]
    assert _stored_windows(0, prompt, peek=(False, True)) == {7, 8, 11, 12}
    assert _stored_windows(64, prompt, peek=(False, True)) == {7, 8, 11, 12, 15}
    assert _stored_windows(0, prompt, junction=64, peek=(False, True)) == {3, 4, 7, 8, 11, 12}


@pytest.mark.parametrize("spec", [
    dict(kind="sliding_window", tokens=8, retention=-1),
    dict(kind="sliding_window", tokens=8, retention=True),
    dict(kind="sliding_window", tokens=8, retention=1.0),
    dict(kind="sliding_window", tokens=8, cached=False, retention=0),
    dict(kind="full_attention", retention=0),
    dict(kind="mamba", retention=-32),  # (a Mamba group takes one: its sparse states)
    dict(kind="chunked_local_attention", tokens=8, retention=0),
])
def test_a_retention_but_a_cached_windows_int_at_least_0_is_a_config_error(spec):
    with pytest.raises(ConfigError, match="retention="):
        GroupSpec(**spec)


@pytest.mark.parametrize(("sizes", "retention", "words"), [
    (BlockSizes.of([16, 16], peek=(False, True)), 0, "without peek"),  # (one size: served, not with peek)
    (16, 24, "multiple of align 16"),
    (BlockSizes.of([32, 8]), 48, "multiple of align 32"),
])
def test_a_retention_where_it_is_not_served_is_a_config_error(sizes, retention, words):
    with pytest.raises(ConfigError, match=words):
        HybridKVCacheManager([full_attention(), sliding_window(8, retention=retention)], 100, sizes)


def test_a_negative_junction_is_a_request_error_before_any_change():
    m = HybridKVCacheManager([full_attention(), sliding_window(8, retention=0)], 100, BlockSizes.of([32, 8]))
    free = m.num_free_blocks
    with pytest.raises(RequestError, match="junction"):
        m.add_request("r", list(range(40)), junction=-32)
    assert m.num_free_blocks == free
    assert m.add_request("r", list(range(40))) is not None  # (the id was not taken)
