"""vLLM's ``KVCacheBlock`` objects of a HiSparse manager's two pools (hisparse_manager.py),
``ref_cnt`` read live as vLLM counts it: the holds in prefixkv's pool (a live request's,
another user's, a freed request's copy still in flight) and one more for each copy in
flight of a live request's page (vLLM's coordinator touches both ends of a transfer, and
frees them when it is confirmed). Caching is off: no block holds a hash. Block 0, the
null block, is a plain ``KVCacheBlock`` at 0 (block_objects.py's ``PoolBlock`` says the
rest: writes refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from .block_objects import PoolBlock

if TYPE_CHECKING:
    from prefixkv.core.block import Block
    from prefixkv.groups.hisparse.state import HiSparseState

__all__ = ["pool_blocks"]


class _NoHashes:
    """A ``HashSource`` of blocks that never hold a findable content (caching off)."""

    def hash_entry(self, core_id: int) -> tuple[bytes, int] | None:
        return None

    def gone(self, request: Any, ids: Sequence[Sequence[int]]) -> None:
        """Nothing to keep."""

    def keeping(self) -> bool:
        return False


def _in_flight(state: HiSparseState, host: bool, block_id: int) -> int:
    """How many copies in flight of a live request's page have ``block_id`` as an end
    (its host block when ``host``, else its GPU block)."""
    n = 0
    for key, page in state.spills.flight.values():
        if key is not None:
            host_ids, _, row, _, _ = state.request(key)
            n += (host_ids if host else row)[page] == block_id
    return n


def pool_blocks(state: HiSparseState, host: bool) -> list[KVCacheBlock]:
    """vLLM's block objects of ``state``'s host pool (``host``) or device pool, one per id
    (module doc)."""
    pool: list[Block] = state.host.blocks if host else state.device.blocks

    def refs(i: int) -> int:
        return pool[i].ref_cnt + _in_flight(state, host, i)

    hashes = _NoHashes()
    return [KVCacheBlock(0, is_null=True), *(PoolBlock(i, refs, i, hashes) for i in range(1, len(pool)))]
