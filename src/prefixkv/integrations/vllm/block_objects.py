"""vLLM's ``KVCacheBlock`` objects over prefixkv's pool: ``ref_cnt`` read live.

vLLM's scheduler, connectors and tests read ``block.ref_cnt`` of the blocks its manager
hands out (``KVCacheBlocks``, ``block_pool.blocks``, the free queue's list, popped
blocks). prefixkv keeps the count in its own pool, so each ``PoolBlock`` reads it from
there when asked (nothing is written to these objects at admission or release): how
many live requests hold the block, as vLLM counts (a request's blocks popped by
``pop_blocks_for_free`` count until ``free_blocks`` takes them back; vLLM's null block,
``is_null``, is never counted and stays a plain ``KVCacheBlock`` at 0).

Its hash (``block_hash``, ``_block_hash``: vLLM's ``BlockHashWithGroupId``;
``block_hash_num_tokens``) is read the same way, from what prefixkv's block holds
(block_hash_view.py says how, and where it is refused): None while it holds no findable
content, as vLLM's block before it is cached and after it is evicted.

Its free-list links (``prev_free_block``, ``next_free_block``) are read from prefixkv's
free order when asked (free_links.py): None while a request holds it.

Writing ``ref_cnt``, a hash field or a link, ``set_block_hash`` and ``reset_hash`` raise
UnsupportedByPrefixKV: the count and the content are prefixkv's, changed only by its
manager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from .layout import UnsupportedByPrefixKV

__all__ = ["HashSource", "PoolBlock", "RefCount"]

RefCount = Callable[[int], int]
"""prefixkv's count of one of its block ids (``KVCacheManager.ref_cnt``)."""


class HashSource(Protocol):
    """vLLM's hash of what one of prefixkv's blocks holds (block_hash_view.py)."""

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        """(vLLM's ``BlockHashWithGroupId``, the tokens it covers) of prefixkv block
        ``core_id``, None while it holds no findable content."""

    def gone(self, request: Any, ids: Sequence[Sequence[int]]) -> None:
        """``request`` goes from prefixkv blocks ``ids`` (per group): what a later read
        of their hashes needs is kept."""

    def keeping(self) -> bool:
        """Whether ``gone`` keeps anything now (a block's hash was read), so a free that
        would only pass it the ids can skip them."""

class PoolBlock(KVCacheBlock):
    """vLLM's ``KVCacheBlock`` of vLLM block id ``block_id``, prefixkv's block
    ``core_id``: ``ref_cnt`` is ``refs(core_id)``, the hash fields are
    ``hashes.hash_entry(core_id)``'s and the links ``hashes.free_neighbours(core_id)``
    (pool.Blocks') when read; writes are refused."""

    __slots__ = ("_refs", "_core_id", "_hashes")

    # vLLM's fields that only its own pool writes, read here as its defaults (class
    # attributes over vLLM's slots: nothing to write a block made)
    pool = None
    is_null = False

    def __init__(self, block_id: int, refs: RefCount, core_id: int,
                 hashes: HashSource) -> None:  # (not vLLM's: no ref_cnt, no hash)
        self.block_id = block_id  # type: ignore[misc]  # (vLLM's slot, unseen by mypy)
        self._refs, self._core_id, self._hashes = refs, core_id, hashes

    @property
    def ref_cnt(self) -> int:
        """How many live requests hold the block (prefixkv's count)."""
        return self._refs(self._core_id)

    @ref_cnt.setter
    def ref_cnt(self, n: int) -> None:
        self._refuse(f"ref_cnt = {n!r}")

    @property
    def _block_hash(self) -> bytes | None:
        """vLLM's ``BlockHashWithGroupId`` of the content the block holds, None while it
        holds none."""
        entry = self._hashes.hash_entry(self._core_id)
        return None if entry is None else entry[0]

    @_block_hash.setter
    def _block_hash(self, value: object) -> None:
        self._refuse(f"_block_hash = {value!r}")

    @property
    def _block_hash_num_tokens(self) -> int | None:
        """The prefix tokens the hash covers (the block's end), None without one."""
        entry = self._hashes.hash_entry(self._core_id)
        return None if entry is None else entry[1]

    @_block_hash_num_tokens.setter
    def _block_hash_num_tokens(self, value: object) -> None:
        self._refuse(f"_block_hash_num_tokens = {value!r}")

    @property
    def prev_free_block(self) -> KVCacheBlock | None:
        """The block before it in vLLM's free list (free_links.py), None while in use."""
        return self._neighbours()[0]

    @prev_free_block.setter
    def prev_free_block(self, value: object) -> None:
        self._refuse(f"prev_free_block = {value!r}")

    @property
    def next_free_block(self) -> KVCacheBlock | None:
        """The block after it in vLLM's free list (free_links.py), None while in use."""
        return self._neighbours()[1]

    @next_free_block.setter
    def next_free_block(self, value: object) -> None:
        self._refuse(f"next_free_block = {value!r}")

    def _neighbours(self) -> tuple[KVCacheBlock | None, KVCacheBlock | None]:
        # (pool.Blocks, the source of the plug-in's blocks, answers; other sources keep
        # no view of a free list: None, as a block in use)
        read = getattr(self._hashes, "free_neighbours", None)
        return (None, None) if read is None else read(self._core_id)

    def set_block_hash(self, block_hash: object, num_tokens: int | None = None) -> None:
        self._refuse("set_block_hash()")

    def reset_hash(self) -> None:
        self._refuse("reset_hash()")

    def _refuse(self, what: str) -> None:
        raise UnsupportedByPrefixKV(f"KVCacheBlock({self.block_id}).{what}: prefixkv's pool keeps the "
                                    f"count and the content; its manager alone changes them")
