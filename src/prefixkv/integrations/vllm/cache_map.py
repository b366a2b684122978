"""vLLM's ``cached_block_hash_to_block._cache`` (its dict: ``BlockHashWithGroupId`` -> the
block cached under it, or ``{block_id: block}`` where several blocks hold that prefix in
a group), read-only, as prefixkv's block objects show their hashes.

Each read builds the map anew from the pool's ``KVCacheBlock`` objects: a block whose
``block_hash`` is set (block_hash_view.py: vLLM's hash of the findable content it holds)
is listed under it, so the map holds what vLLM's does wherever those hashes are vLLM's
(the differences: docs/integration.md's block objects). Where prefixkv's blocks show no
hash (a layout that view does not serve) the map is refused with UnsupportedByPrefixKV
rather than shown empty. Its writes (``pop``, ``[key] = block``, ``del``, ``clear`` ...)
are refused: content leaves prefixkv's index by eviction alone (``evict_blocks``), and
enters it only through its manager's calls, so a block is never found for KV it was not
given. ``copy.copy`` of it is a plain dict, the caller's own. O(blocks) a read: a view
for tests and inspection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from .layout import UnsupportedByPrefixKV

__all__ = ["CacheMap", "cache_map"]


def cache_map(table: Sequence[Any], unserved: str | None) -> CacheMap:
    """The map of the pool's block objects ``table`` (vLLM's null block at 0, skipped);
    ``unserved``: why the blocks show no hash (None: they do). Raises
    UnsupportedByPrefixKV where they do not."""
    if unserved is not None:
        raise UnsupportedByPrefixKV(f"cached_block_hash_to_block._cache: prefixkv's block objects show "
                                    f"no hash here ({unserved})")
    found: dict[bytes, Any] = {}
    for block in table[1:]:
        key = block.block_hash
        if key is None:
            continue
        held = found.get(key)
        if held is None:
            found[key] = block
        elif isinstance(held, dict):
            held[block.block_id] = block
        else:
            found[key] = {held.block_id: held, block.block_id: block}
    return CacheMap(found)


class CacheMap(dict[bytes, Any]):
    """A snapshot of vLLM's ``_cache``: reads as a dict; writes raise UnsupportedByPrefixKV."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedByPrefixKV("cached_block_hash_to_block._cache is read-only: prefixkv's index "
                                    "changes through its manager's calls (evict_blocks makes content "
                                    "unfindable)")

    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = __ior__ = _refuse

    def __copy__(self) -> dict[bytes, Any]:
        return dict(self)
