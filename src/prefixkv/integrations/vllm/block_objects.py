"""vLLM's ``KVCacheBlock`` objects over prefixkv's pool: ``ref_cnt`` read live.

vLLM's scheduler, connectors and tests read ``block.ref_cnt`` of the blocks its manager
hands out (``KVCacheBlocks``, ``block_pool.blocks``, the free queue's list, popped
blocks). prefixkv keeps the count in its own pool, so each ``PoolBlock`` reads it from
there when asked (nothing is written to these objects at admission or release): how
many live requests hold the block, as vLLM counts (a request's blocks popped by
``pop_blocks_for_free`` count until ``free_blocks`` takes them back; vLLM's null block,
``is_null``, is never counted and stays a plain ``KVCacheBlock`` at 0).

Writing ``ref_cnt`` raises UnsupportedByPrefixKV: the count is prefixkv's, changed only
by its manager. The block hash fields (``block_hash``, ``_block_hash``,
``block_hash_num_tokens``) stay vLLM's defaults (None): prefixkv finds content without
vLLM's hashes (block_hashes.py turns a hash into a prefix, not a block into its hash).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from .layout import UnsupportedByPrefixKV

__all__ = ["PoolBlock", "RefCount"]

RefCount = Callable[[int], int]
"""prefixkv's count of one of its block ids (``KVCacheManager.ref_cnt``)."""


class PoolBlock(KVCacheBlock):
    """vLLM's ``KVCacheBlock`` of vLLM block id ``block_id``, prefixkv's block
    ``core_id``: ``ref_cnt`` is ``refs(core_id)`` when read, a write is refused."""

    __slots__ = ("_refs", "_core_id")

    def __init__(self, block_id: int, refs: RefCount, core_id: int) -> None:  # (not vLLM's: no ref_cnt)
        # (vLLM's slots, which mypy does not see through its slots dataclass)
        self.block_id, self.pool, self.is_null = block_id, None, False  # type: ignore[misc]
        self._block_hash = self._block_hash_num_tokens = None  # type: ignore[misc]
        self.prev_free_block = self.next_free_block = None  # type: ignore[misc]
        self._refs, self._core_id = refs, core_id

    @property
    def ref_cnt(self) -> int:
        """How many live requests hold the block (prefixkv's count)."""
        return self._refs(self._core_id)

    @ref_cnt.setter
    def ref_cnt(self, n: int) -> None:
        raise UnsupportedByPrefixKV(f"KVCacheBlock({self.block_id}).ref_cnt = {n!r}: prefixkv's pool "
                                    f"keeps the count; its manager alone changes it")
