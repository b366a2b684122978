"""The blocks ``KVCacheManager.pop_blocks_for_free`` handed out and vLLM has not given
back yet (with ``block_pool.free_blocks``).

vLLM's scheduler frees a request's blocks later than it forgets the request (a deferred
free): the manager forgets the request's vLLM id at once and keeps prefixkv's request
holding its blocks until they come back; any one of them coming back frees the whole
request. Each handed-out block is a fresh ``KVCacheBlock`` object, so the object itself
(``id``) names the entry: a block given back twice, or one this manager never handed
out, is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from prefixkv.errors import RequestError

__all__ = ["PoppedBlocks"]


class PoppedBlocks:
    """Handed-out blocks, each naming prefixkv's request (``key``) that still holds it."""

    def __init__(self) -> None:
        # id(block) of each popped block -> (key, the popped blocks)
        self._popped: dict[int, tuple[int, list[KVCacheBlock]]] = {}

    def hand_out(self, key: int, blocks: list[KVCacheBlock]) -> None:
        """Remember ``blocks`` (fresh objects, all of request ``key``) as handed out."""
        entry = (key, blocks)
        for b in blocks:
            self._popped[id(b)] = entry

    def take_back(self, blocks: Iterable[KVCacheBlock]) -> list[int]:
        """Forget the handed-out entries these blocks belong to, whole; the keys of their
        requests, to be freed. Raises RequestError, before any change, for a block not
        handed out (or given back already)."""
        entries = {}
        for b in blocks:
            entry = self._popped.get(id(b))
            if entry is None:
                raise RequestError(f"block {b.block_id} was not handed out by pop_blocks_for_free "
                                   f"(or was given back already)")
            entries[entry[0]] = entry
        for _, popped in entries.values():
            for x in popped:
                del self._popped[id(x)]
        return list(entries)
