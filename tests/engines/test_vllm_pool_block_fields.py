"""The plug-in's ``PoolBlock`` (block_objects.py) has every field of vLLM's
``KVCacheBlock`` set: vLLM code that reads a table's block objects (a connector, the
scheduler's asserts) finds the hash its ``HashSource`` answers (None: no findable
content), no free-list links, not null; ``ref_cnt`` is prefixkv's count. Needs vllm."""

from __future__ import annotations

import os

import pytest

from . import skip_module_without_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
skip_module_without_vllm()

from prefixkv.integrations.vllm.block_objects import PoolBlock  # noqa: E402
from prefixkv.integrations.vllm.layout import UnsupportedByPrefixKV  # noqa: E402


def test_a_pool_block_reads_as_vllms_block_with_prefixkvs_count():
    class NoContent:  # (a HashSource: block 7 holds no findable content)
        def hash_entry(self, core_id: int) -> None:
            return None

    counts = {7: 2}
    b = PoolBlock(3, counts.__getitem__, 7, NoContent())
    assert (b.block_id, b.is_null, b.block_hash, b.prev_free_block, b.next_free_block) == \
        (3, False, None, None, None)
    assert b.ref_cnt == 2
    counts[7] = 0
    assert b.ref_cnt == 0
    with pytest.raises(UnsupportedByPrefixKV):
        b.ref_cnt = 1
