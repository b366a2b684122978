"""The hit vLLM's scheduler asks for under a cap: ``max_cache_hit_length`` (the longest
hit every group serves within it, then admitted as reported) and EAGLE's shortened hit
(``use_eagle``: one full-attention group drops the hit's last block, as vLLM's
``FullAttentionManager`` does; beside a window every group matches one block past the
hit, then drops it). Exact vLLM block ids; block_size 16. Needs vllm installed
(``make install-vllm``); test_vllm_eagle_reference.py runs streams beside vLLM's own."""

from __future__ import annotations

import pytest

from prefixkv import RequestError

from . import skip_module_without_vllm
from .test_vllm_plugin import BS, config, full, manager, request, window

skip_module_without_vllm()


def chunked():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from .test_vllm_plugin import torch

    return ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                     attention_chunk_size=32)


def align_mamba():
    from vllm.v1.kv_cache_interface import MambaSpec

    from .test_vllm_plugin import torch

    return MambaSpec(block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align")


def primed(m, tokens):
    """``m`` with a request of ``tokens`` computed and freed (its full blocks cached)."""
    a = request("a", tokens)
    assert m.allocate_slots(a, len(tokens)) is not None
    a.num_computed_tokens = len(tokens)
    m.free(a)


@pytest.mark.parametrize(("n", "hit"), [(48, 16), (37, 16), (33, 16), (32, 0), (17, 0)])
def test_eagle_hit_drops_its_last_block(n, hit):
    m = manager(use_eagle=True)
    primed(m, list(range(48)))  # blocks 1, 2, 3 cached
    b = request("b", list(range(n)))
    blocks, got, _ = m.get_computed_blocks(b)
    assert got == hit and blocks.get_block_ids() == ([1][:hit // BS],)
    new = m.allocate_slots(b, n - hit, hit, blocks)
    assert new is not None
    assert m.get_block_ids("b")[0][:hit // BS] == [1][:hit // BS]
    # the dropped block is computed again into a block of b's own
    assert 2 not in m.get_block_ids("b")[0]


def test_without_eagle_the_same_prompt_hits_both_blocks():
    m = manager()
    primed(m, list(range(48)))
    assert m.get_computed_blocks(request("b", list(range(48))))[1] == 32


def test_a_capped_one_group_hit_is_its_blocks_below_the_cap():
    m = manager()
    primed(m, list(range(48)))
    b = request("b", list(range(48)))
    blocks, hit, _ = m.get_computed_blocks(b, max_cache_hit_length=31)
    assert hit == 16 and blocks.get_block_ids() == ([1],)
    assert m.allocate_slots(b, 32, hit, blocks).get_block_ids() == ([4, 5],)
    assert m.get_block_ids("b") == ([1, 4, 5],)


def test_a_capped_hybrid_hit_is_the_longest_the_window_serves_below_the_cap():
    from prefixkv.integrations.vllm import KVCacheManager

    # full attention and a 32-token window (a query at p reads p-31 .. p); a's window
    # block 2 (positions 32..47) is evicted: a hit of 4 blocks reads window blocks 2, 3
    m = KVCacheManager(config(full(), window(), num_blocks=31), max_model_len=8192,
                       scheduler_block_size=BS, hash_block_size=BS)
    a = request("a", list(range(97)))
    m.allocate_slots(a, 97)
    a_full, a_window = m.get_block_ids("a")
    lose(m, a_window[2])
    b = request("b", list(range(97)))
    assert m.get_computed_blocks(b)[1] == 96                      # window blocks 4, 5
    assert m.get_computed_blocks(b, max_cache_hit_length=95)[1] == 80   # 3, 4
    blocks, hit, _ = m.get_computed_blocks(b, max_cache_hit_length=64)
    assert hit == 32 and blocks.get_block_ids() == (a_full[:2], a_window[:2])
    new = m.allocate_slots(b, 65, hit, blocks)
    assert new is not None and [ids[:2] for ids in m.get_block_ids("b")] == [a_full[:2], a_window[:2]]


def test_an_admission_whose_hit_is_not_the_reported_one_is_refused():
    m = manager()
    primed(m, list(range(48)))
    b = request("b", list(range(48)))
    with pytest.raises(RequestError, match="not the 48"):
        m.allocate_slots(b, 16, 48)  # (more than the cache holds: not a lookup's answer)
    assert m.get_block_ids("b") == ([],)


def test_eagle_beside_a_window_needs_the_block_after_the_hit_in_both_groups():
    from prefixkv.integrations.vllm import KVCacheManager

    # full attention and a 32-token window: a hit of h blocks needs window blocks h-2 ..
    # h (h peeked); a's window block 3 (48..63) evicted
    m = KVCacheManager(config(full(), window(), num_blocks=31), max_model_len=8192,
                       scheduler_block_size=BS, hash_block_size=BS, use_eagle=True)
    a = request("a", list(range(97)))
    m.allocate_slots(a, 97)
    a_full, a_window = m.get_block_ids("a")
    # the prompt's 6 full blocks: a hit of 5 peeks at block 5, the last full one
    assert m.get_computed_blocks(request("b", list(range(97))))[1] == 80
    lose(m, a_window[3])
    b = request("b", list(range(97)))
    # hits of 5..3 read or peek at window block 3; 2 peeks at block 2 and reads 0, 1
    blocks, hit, _ = m.get_computed_blocks(b)
    assert hit == 32 and blocks.get_block_ids() == (a_full[:2], a_window[:2])
    assert m.allocate_slots(b, 65, hit, blocks) is not None
    assert [ids[:2] for ids in m.get_block_ids("b")] == [a_full[:2], a_window[:2]]
    # one window group alone (vLLM's unitary coordinator): the block peeked at lies
    # within the cap (num_tokens - 1): 33 tokens, cap 32, a hit of 1 peeking at block 1
    w = KVCacheManager(config(window(), num_blocks=11), max_model_len=8192,
                       scheduler_block_size=BS, hash_block_size=BS, use_eagle=True)
    primed(w, list(range(48)))
    assert w.get_computed_blocks(request("c", list(range(33))))[1] == 16
    assert w.get_computed_blocks(request("c", list(range(48))))[1] == 16


@pytest.mark.parametrize(("specs", "named"), [
    (lambda: (full(), window(), window(64)), "one other group spec"),
    (lambda: (window(), window(64)), "one other group spec"),
    (lambda: (full(), window(), align_mamba()), "one other group spec"),
    (lambda: (full(), chunked()), "full-attention, sliding-window and Mamba groups only"),
])
def test_eagle_where_vllm_finds_its_hit_otherwise_is_refused(specs, named):
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    with pytest.raises(UnsupportedByPrefixKV, match=named):
        manager(*specs(), use_eagle=True)


def test_eagle_flagged_on_the_draft_models_group_peeks_there_only():
    from prefixkv.integrations.vllm import KVCacheManager

    # as test_eagle_beside_a_window_needs_the_block_after_the_hit_in_both_groups, but
    # vLLM flags the full-attention group only (is_eagle_group: its draft model's layers):
    # a hit of 5 peeks at the full group's block 5 and reads window blocks 3 (gone), 4;
    # a hit of 3 reads window blocks 1, 2
    cfg = config(full(), window(), num_blocks=31)
    cfg.kv_cache_groups[0].is_eagle_group = True
    m = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS,
                       use_eagle=True)
    assert m.eagle_groups == (True, False)
    a = request("a", list(range(97)))
    m.allocate_slots(a, 97)
    a_full, a_window = m.get_block_ids("a")
    lose(m, a_window[3])
    blocks, hit, _ = m.get_computed_blocks(request("b", list(range(97))))
    assert hit == 48 and blocks.get_block_ids() == (a_full[:3], [0, *a_window[1:3]])


def test_multi_module_mtp_re_prefillable_tokens_are_refused_beside_other_groups():
    from prefixkv.integrations.vllm import UnsupportedByPrefixKV

    # vLLM's coordinator caches num_computed - (num_prefill_lookahead - 1) tokens (the
    # drafter may prefill the last ones again): prefixkv does so on one full-attention
    # group (tests/engines/test_vllm_reprefill.py), and refuses it beside other groups
    with pytest.raises(UnsupportedByPrefixKV, match="num_prefill_lookahead=2"):
        manager(full(), window(), num_prefill_lookahead=2)
    assert manager(use_eagle=True, num_prefill_lookahead=3).reprefill_tokens == 2
    # EAGLE's one token ahead (1), and no caching: nothing re-prefilled
    assert manager(use_eagle=True, num_prefill_lookahead=1).reprefill_tokens == 0
    assert manager(num_prefill_lookahead=4, enable_caching=False).reprefill_tokens == 0


def lose(m, block_id):
    """The content of vLLM block ``block_id`` goes as an eviction takes it: that block
    alone (``evict_blocks`` reports KV that failed to load: the prefix and what was
    computed after it go too, tests/test_groups_orphans.py)."""
    (core_id,) = m._blocks.core_ids({block_id})
    m.core._index.drop_one(m.core._pool.blocks[core_id])
