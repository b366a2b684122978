"""EAGLE (``use_eagle``) on the vLLM plug-in beside groups of DIFFERENT block sizes
(docs/groups.md, "EAGLE"): vLLM 0.33's own EAGLE cases, run on vLLM's manager and on
prefixkv's (the same hit, each group's table as long), and the layout prefixkv refuses
(a flagged full-attention group larger than the hash block). Needs vllm installed."""

from __future__ import annotations

import os

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()
torch = pytest.importorskip("torch")

from .test_vllm_block_sizes_reference import _request, _spec  # noqa: E402

BS = 8  # (the window's block and the hash block; full attention at 4 * BS: lcm 32)


def _config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], _spec(b, w), is_eagle_group=f)
                                          for i, (b, w, f) in enumerate(groups)])


def _hit(cls, cfg, tokens, more):
    """Prime ``cls``'s manager with ``tokens``, computed whole and freed; the hit of
    ``tokens + more``, and each group's hit entries."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    m = cls(cfg, max_model_len=8192, enable_caching=True, hash_block_size=BS, scheduler_block_size=4 * BS,
            use_eagle=True)
    r = _request("0", tokens, BS)
    blocks, n, *_ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens), n, blocks) is not None
    m.free(r)
    blocks, n, *_ = m.get_computed_blocks(_request("1", tokens + more, BS))
    return n, [len(b) for b in blocks.blocks]


@pytest.mark.parametrize(("groups", "runs", "more", "want"), [
    # vLLM's test_eagle_grouped_swa_siblings_use_same_cache_mask
    (((4 * BS, None, False), (BS, BS, False), (BS, BS, True)), 9, [999], (64, [2, 8, 8])),
    # test_eagle_swa_boundary_caches_post_boundary_block
    (((4 * BS, None, False), (BS, BS, True)), 5, [999], (32, [1, 4])),
    # test_eagle_swa_alignment_caches_extra_block
    (((4 * BS, None, False), (BS, BS, True)), 16, [], (96, [3, 12])),
])
def test_eagle_hits_beside_groups_of_different_sizes_are_vllms(groups, runs, more, want):
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    from prefixkv.integrations.vllm import KVCacheManager

    tokens = [i for i in range(runs) for _ in range(BS)]
    assert _hit(VllmManager, _config(*groups), tokens, more) == want
    assert _hit(KVCacheManager, _config(*groups), tokens, more) == want


def test_a_flagged_full_group_larger_than_the_hash_block_is_refused():
    from prefixkv.integrations.vllm import KVCacheManager, UnsupportedByPrefixKV

    # every group flagged (none is): full attention at 32 beside a window at 8, hash 8
    with pytest.raises(UnsupportedByPrefixKV, match="full attention of the hash block's size"):
        KVCacheManager(_config((4 * BS, None, False), (BS, BS, False)), max_model_len=8192,
                       hash_block_size=BS, scheduler_block_size=4 * BS, use_eagle=True)
