"""HiSparse with prefix caching on and external (connector) loads in one stream:
test_vllm_hisparse_cache.py's side-by-side streams against vLLM 0.33's own manager
(every answer compared, wrong KV tracked) with loads among the ops: a new request's
load as its first allocation (asynchronous, caching delayed; or synchronous, cached at
once), ended done (its pages published, hit and adopted; its last page restored) or
failed (the request freed; a synchronous load's blocks evicted first as the scheduler's
invalid blocks), or freed mid-load; a load after a hit (the host hit kept to the load's
pages). Then scenarios with exact values, the same as vLLM's. Needs vllm installed."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import skip_module_without_vllm

skip_module_without_vllm()

from vllm.v1.hisparse.coordinator import get_hisparse_coordinator  # noqa: E402

from .hisparse_model import BS, MAX_LEN  # noqa: E402
from .test_vllm_block_sizes_reference import _request  # noqa: E402
from .test_vllm_hisparse import hisparse_config, vllm_manager  # noqa: E402
from .test_vllm_hisparse_cache import OP, _none_hash, side_by_side  # noqa: E402, F401
from .test_vllm_hisparse_manager import _plugin_manager  # noqa: E402

_LOAD = st.tuples(st.just("load"), st.integers(0, 2), st.integers(1, 90), st.integers(0, 7))
_FINISH = st.tuples(st.just("finish"), st.integers(0, 2), st.sampled_from([0, 0, 0, 1]), st.just(0))
_EVICT = st.tuples(st.just("evict"), st.integers(0, 2), st.integers(0, 7), st.sampled_from([0, 0, 1]))
LOAD_OPS = st.lists(st.one_of(OP, _LOAD, _LOAD, _FINISH, _FINISH, _EVICT), min_size=12, max_size=50)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(12, 40), host_blocks=st.integers(8, 32),
       in_flight=st.sampled_from([32, 64, MAX_LEN]), reprefill=st.sampled_from([0, 0, 2]), ops=LOAD_OPS)
def test_random_streams_with_external_loads_answer_as_vllm(
        num_blocks: int, host_blocks: int, in_flight: int, reprefill: int,
        ops: list[tuple[str, int, int, int]]) -> None:
    """The streams above with external loads among them: a new request's load (no hit),
    ended done or failed by the connector, freed mid-load; its pages published, hit and
    adopted beside restores as vLLM does, never a wrong KV."""
    side_by_side(num_blocks, host_blocks, in_flight, reprefill, ops)


MIX = "aaaacccfffsdlllnnrtgep"  # (one letter an op, as often as it appears)
AFTER_HITS = "aacccccffflllllnnneee"  # (loads after hits whose indexer pages were evicted)


def seeded_ops(seed: int, mix: str = MIX
               ) -> tuple[tuple[int, int, int, int], list[tuple[str, int, int, int]]]:
    """A stream's shape and ops from ``seed``: admissions, loads and their ends weighed up
    (a hit on loaded pages needs a load done, a confirmation and an admission), or as
    ``mix`` weighs them."""
    r = random.Random(seed)
    shape = (r.randint(12, 40), r.randint(8, 32), r.choice([32, 64, MAX_LEN]), r.choice([0, 0, 2]))
    ops = {"a": lambda: ("admit", r.randint(0, 2), r.randint(1, 80), r.randint(0, 7)),
           "c": lambda: ("confirm", r.randint(0, 2**16 - 1), 0, r.randint(0, 1)),
           "f": lambda: ("free", r.randint(0, 2), r.randint(0, 1), 0),
           "s": lambda: ("step", r.randint(0, 2), r.randint(1, 48), r.randint(0, 3)),
           "d": lambda: ("decode", r.randint(0, 2), r.randint(1, 3), 0),
           "l": lambda: ("load", r.randint(0, 2), r.randint(1, 90), r.randint(0, 7)),
           "n": lambda: ("finish", r.randint(0, 2), r.choice([0, 0, 0, 1]), 0),
           "r": lambda: ("reset", 0, 0, 0),
           "t": lambda: ("take", r.randint(1, 8), 0, r.randint(0, 1)),
           "g": lambda: ("give_back", 0, 0, 0),
           "e": lambda: ("evict", r.randint(0, 2), r.randint(0, 7), r.choice([0, 0, 1])),
           "p": lambda: ("pop", r.randint(0, 2), 0, 0)}
    return shape, [ops[r.choice(mix)]() for _ in range(r.randint(12, 60))]


@pytest.mark.parametrize("seed", range(40))
def test_seeded_streams_with_external_loads_answer_as_vllm(seed: int) -> None:
    shape, ops = seeded_ops(seed)
    side_by_side(*shape, ops)


@pytest.mark.parametrize("seed", range(20))
def test_seeded_streams_of_loads_after_hits_answer_as_vllm(seed: int) -> None:
    """Streams weighed toward loads after hits whose indexer pages were evicted (the host
    hit kept past the indexer's)."""
    shape, ops = seeded_ops(seed, AFTER_HITS)
    side_by_side(*shape, ops)


def test_exact_values_of_an_external_load_published_hit_and_its_restore_indexed() -> None:
    """A synchronous load of 48 tokens (3 whole pages): its indexer pages cached at the
    allocation, its host pages published only once the load is done (never while it is
    pending: no wrong hit on pages not written yet), the whole last page too while its
    restore is in flight; the restore confirmed, that page's GPU block is indexed as the
    host block's copy. The same values as vLLM's manager (checked by running both)."""
    probe_tokens = list(range(64))
    cfg = hisparse_config(32, 16)
    for side, m in enumerate((vllm_manager(cfg, max_model_len=MAX_LEN, enable_caching=True),
                              _plugin_manager(cfg, enable_caching=True))):
        seam = get_hisparse_coordinator(m)
        loaded = _request("loaded", list(range(48)) + [7000, 7001], BS)
        got = m.allocate_slots(loaded, 0, num_external_computed_tokens=48)
        assert got.get_block_ids() == ([], [], [], [5, 6]), side
        assert m.get_block_ids("loaded") == ([1, 2, 3], [1, 2, 3], [0, 0, 4], [5, 6])
        assert [b.block_hash is not None for b in m.get_blocks("loaded").blocks[1]] == [True] * 3
        probe = _request("probe", probe_tokens, BS)
        assert m.get_computed_blocks(probe)[1] == 0, side  # (pending: nothing published)
        seam.finish_host_import("loaded", failed=False)
        m.cache_blocks(loaded, 48)
        blocks, hit, _ = m.get_computed_blocks(probe)
        assert (blocks.get_block_ids(), hit) == (([1, 2, 3], [1, 2, 3], [], []), 48), side
        sent = seam.build_offload_command().page_transfers
        assert [(t.resident_block_ids, t.restore) for t in sent] == [((4,), True)]
        assert not seam.copies
        seam.update_spills({sent[0].transfer_id: 1}, {sent[0].transfer_id: 1})
        assert [[b.block_id for b in bs] for bs in seam.copies.values()] == [[4]], side


def test_a_pending_load_with_new_tokens_publishes_nothing() -> None:
    """A synchronous load of 48 tokens with 16 new ones: the caching wish reaches 64
    tokens, but no host page is published before the load is done (main gave a hit of
    16 tokens here, on a page the load had not written: a wrong KV); vLLM's 0."""
    cfg = hisparse_config(32, 16)
    for m in (vllm_manager(cfg, max_model_len=MAX_LEN, enable_caching=True),
              _plugin_manager(cfg, enable_caching=True)):
        get_hisparse_coordinator(m)  # (vLLM's manager needs its coordinator first)
        m.allocate_slots(_request("loaded", list(range(70)), BS), 16, num_external_computed_tokens=48)
        assert m.get_computed_blocks(_request("probe", list(range(64)), BS))[1] == 0, type(m).__name__


def _published_and_freed(m: Any, tokens: list[int], evicted: int) -> Any:
    """Request "first" of ``tokens`` computed whole, its copies confirmed (published), the
    hash of its device block ``evicted`` dropped while held (so the block is reused first
    once freed, on both sides), then freed; ``m``'s coordinator."""
    seam = get_hisparse_coordinator(m)
    first = _request("first", tokens, BS)
    m.allocate_slots(first, len(tokens))
    seam.advance_scheduled([("first", len(tokens))])
    sent = {t.transfer_id: 1 for t in seam.build_offload_command().page_transfers}
    seam.update_spills(sent, sent)
    m.evict_blocks({evicted})
    m.free(first)
    return seam


def test_exact_values_of_an_external_load_after_a_hit() -> None:
    """A request of 64 tokens published whole, its indexer's page 2 evicted, then freed;
    another of the same tokens hits 32 tokens (the host hit 48) and loads 16 more: the
    host hit kept to 3 pages (page 2 the hit's published block, not a new one), the
    indexer's page 2 new, the row's page 2 a writable GPU page, the hot region taken; no
    copy while the load is pending (pages 0 and 1 valid: the hit's), and nothing more
    published; done, page 2 restored from host, valid, hit again and indexed as a copy
    once confirmed. The same values as vLLM's manager (checked by running both)."""
    cfg, tokens = hisparse_config(32, 16), list(range(64))
    for side, m in enumerate((vllm_manager(cfg, max_model_len=MAX_LEN, enable_caching=True),
                              _plugin_manager(cfg, enable_caching=True))):
        seam = _published_and_freed(m, tokens, 3)  # (the indexer's page 2)
        probe = _request("probe", tokens, BS)
        blocks, hit, boundary = m.get_computed_blocks(probe)
        assert (blocks.get_block_ids(), hit, boundary) == (([1, 2, 3], [1, 2], [], []), 32, 48), side
        got = m.allocate_slots(probe, 1, num_new_computed_tokens=32, new_computed_blocks=blocks,
                               num_external_computed_tokens=16)
        assert got.get_block_ids() == ([5], [10], [11], [12, 13]), side
        assert m.get_block_ids("probe") == ([1, 2, 3, 5], [1, 2, 3, 10], [0, 0, 9, 11], [12, 13]), side
        assert [b.ref_cnt for b in m.get_blocks("probe").blocks[0]] == [1, 1, 1, 1]
        seam.advance_scheduled([("probe", 49)])
        row = seam.resident_managers[0].get_residency_row("probe")
        assert [b.block_id for b in row] == [5, 6, 9, 11], side  # (pages 0 and 1 adopted)
        assert not seam.build_offload_command().page_transfers
        state = seam.request_states["probe"]
        assert (sorted(state.valid_pages), state.ready_prefix_pages) == ([0, 1], 2), side
        assert m.get_computed_blocks(_request("p2", tokens, BS))[1:] == (48, 0)  # (first's, kept)
        seam.finish_host_import("probe", failed=False)
        sent = seam.build_offload_command().page_transfers
        assert [(t.resident_block_ids, t.host_block_id, t.restore) for t in sent] == [((9,), 3, True)]
        state = seam.request_states["probe"]
        assert (sorted(state.valid_pages), state.ready_prefix_pages) == ([0, 1, 2], 3), side
        m.cache_blocks(probe, 48)
        blocks, hit, _ = m.get_computed_blocks(_request("p2", tokens, BS))
        assert (blocks.get_block_ids(), hit) == (([1, 2, 3], [1, 2, 3], [], []), 48), side
        seam.update_spills({sent[0].transfer_id: 1}, {sent[0].transfer_id: 1})
        assert sorted(b[0].block_id for b in seam.copies.values()) == [5, 6, 8, 9], side  # (8: first's)
        counts = m.block_pool.get_num_free_blocks(), seam.get_host_block_pool().get_num_free_blocks()
        assert counts == (23, 11), side


@pytest.mark.parametrize("spare", range(-2, 3))
def test_a_load_after_a_short_hit_is_counted_as_vllm(spare: int) -> None:
    """A hit of one indexer page (page 1 evicted) and a load of 32 tokens more, 16 new
    tokens: vLLM counts the row as an import's (its tail page and the pages past the
    import: 2, not the 3 past the hit), the hit's free indexer block and the hot region.
    With the device pool left ``spare`` blocks off that count (another user holding the
    rest), both managers admit it or refuse it alike, with the same blocks."""
    cfg, tokens = hisparse_config(24, 16), list(range(64))
    answers = []
    for m in (vllm_manager(cfg, max_model_len=MAX_LEN, enable_caching=True),
              _plugin_manager(cfg, enable_caching=True)):
        _published_and_freed(m, tokens, 2)  # (the indexer's page 1)
        probe = _request("probe", tokens, BS)
        blocks, hit, boundary = m.get_computed_blocks(probe)
        assert (hit, boundary) == (16, 48)
        need = 3 + 1 + 2 + 2  # (indexer pages 1-3, its free hit block, row: tail and page 3, hot region)
        m.block_pool.get_new_blocks(m.block_pool.get_num_free_blocks() - need - spare)
        got = m.allocate_slots(probe, 16, num_new_computed_tokens=16, new_computed_blocks=blocks,
                               num_external_computed_tokens=32)
        answers.append(None if got is None else (got.get_block_ids(), m.get_block_ids("probe")))
    assert answers[1] == answers[0]
    assert (answers[0] is not None) == (spare >= 0)


def test_a_restore_and_a_publication_confirmed_together_index_the_publications_copy() -> None:
    """A request of 48 tokens, its page 0 confirmed, its indexer page 0 evicted; another of
    the same stem loads 48 tokens synchronously (no hit: the indexer's first page is
    gone); one report confirms the first's pages 1 and 2 and the load's tail restore, both
    of page 2's hash: vLLM indexes the restore's copy first, then the publication's
    (which wins); before session 30 prefixkv indexed them the other way round (a
    Hypothesis stream, seed 33)."""
    seen = side_by_side(17, 9, 32, 0, [("admit", 0, 48, 0), ("confirm", 1, 0, 0), ("evict", 0, 0, 0),
                                       ("load", 1, 48, 6), ("confirm", 7, 0, 0)])
    assert {"loaded synchronously", "load done", "copies"} <= seen, seen
