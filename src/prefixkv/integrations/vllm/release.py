"""What ``manager.KVCacheManager`` gives back or unmarks, over prefixkv's manager: a
request's blocks when it goes (``free``, ``pop_blocks_for_free`` and the pool's
``free_blocks`` of popped blocks), the blocks no window reads any more
(``remove_skipped_blocks``), and the content a connector failed to load
(``evict_blocks``), with the estimate that leaves that content out
(``estimate_cached_tokens``).

Functions of the manager ``m``, whose methods state their contracts; they read and
change its request map, block table and its note of evicted blocks (``m._evicted``),
and hold no state of their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from prefixkv.core.block import blocks_for

from .requests import sound_tokens

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["estimate_cached", "evict", "forget", "free_popped", "free_request", "pop_for_free",
           "release_skipped", "uncache_set_back"]


def forget(m: KVCacheManager, request_id: str) -> int | None:
    """Drop the request's vLLM id and evicted-block note; prefixkv's id of it, None
    when it held no blocks. Its blocks stay held."""
    m._evicted.pop(request_id, None)
    if m._mamba.loading:  # (a load beside Mamba that never landed: mamba.py)
        m._mamba.loading.pop(request_id, None)
    return m._keys.pop(request_id, None)


def uncache_set_back(m: KVCacheManager, key: int, request: Request) -> None:
    """Make unfindable the cached full blocks of the live request ``key`` past the
    tokens vLLM counts computed, as the request goes: their KV is not sound. vLLM's
    scheduler counts fewer than prefixkv cached when (1) it set the count back to a
    block's start, that block's KV found invalid (``kv_load_failure_policy=
    "recompute"``, which calls no ``evict_blocks``), and the request goes before it
    recomputed them; (2) it preempts a running request in the very step that scheduled
    it (priority policy), whose new tokens were cached but never computed. vLLM's own
    manager leaves such blocks findable. From the block holding the first uncomputed
    token for a running request; for a finished one, from the next whole block (vLLM
    recomputes a loaded prompt's last token for its logits: set back inside a block
    whose KV was loaded). A waiting request's count is not read (a load landed: its
    blocks up to the count are sound; vLLM's own tests free such requests uncounted)."""
    n = sound_tokens(request, m.replay_tokens)  # (a replay's tokens are sound)
    scheduled: int = m.core.num_scheduled_tokens(key)
    if request.status == RequestStatus.RUNNING:
        up = False
    elif request.is_finished():
        up = True
    else:
        return
    null = getattr(m.core, "null_block_id", None)  # (each group's blocks at its own size)
    gone = [i for ids, b in zip(m._ids(key), m.group_sizes, strict=True)
            for i in ids[(blocks_for(n, b) if up else n // b):scheduled // b] if i != null]
    if gone:
        m.core.uncache_blocks(gone)


def free_request(m: KVCacheManager, request: Request) -> None:
    """``m.free`` (its contract is there) of ``request``."""
    key = forget(m, request.request_id)
    if key is not None:
        uncache_set_back(m, key, request)
        if m._blocks.keeping():  # (their hashes stay readable: block_hash_view.py)
            m._blocks.gone(request, m._ids(key))
        m.core.free(key)


def pop_for_free(m: KVCacheManager, request: Request) -> list[KVCacheBlock]:
    """``m.pop_blocks_for_free`` (its contract is there) of ``request``."""
    key = forget(m, request.request_id)
    if key is None:
        return []
    uncache_set_back(m, key, request)
    ids = m._ids(key)
    m._blocks.gone(request, ids)
    blocks = [m._blocks.fresh(i) for g in m._blocks.vllm_ids(ids) for i in g]
    m._popped.hand_out(key, blocks)
    return blocks


def free_popped(m: KVCacheManager, blocks: Iterable[KVCacheBlock]) -> None:
    """Free the requests whose popped blocks these are, and give back the blocks copies
    on write held (``take_kv_cache_block_copies``' second list); all checked before any
    change."""
    blocks = list(blocks)
    copies, rest = m._copies.split(blocks)
    keys = m._popped.take_back(rest)
    if copies:
        m.core.release_copies(m._copies.take_back(copies))
    for key in keys:
        m.core.free(key)


def release_skipped(m: KVCacheManager, request_id: str, processed_computed_tokens: int) -> None:
    """``m.remove_skipped_blocks`` (its contract is there)."""
    key = m._keys.get(request_id)
    if key is None or not m._hybrid:
        return
    m.core.bound_release(key, max(0, processed_computed_tokens))
    m.core.release_unread(key)


def evict(m: KVCacheManager, block_ids: set[int]) -> None:
    """``m.evict_blocks`` (its contract is there)."""
    m.core.uncache_blocks(m._blocks.core_ids(block_ids))
    # Where live requests held them cached, for estimate_cached_tokens: by (group,
    # block index), which keeps its block until the request goes (a window's released
    # block may come back to the same request elsewhere). Such a block never regains
    # content: caching goes forward from the request's cached blocks. (A block not yet
    # cached loses nothing and is cached as usual.) Rare: failed loads only.
    gone = set(block_ids)
    for rid in m.live_request_ids():
        cached = m.num_cached_tokens(rid)
        at = {(g, j) for g, (row, b) in enumerate(zip(m.get_block_ids(rid), m.group_sizes, strict=True))
              for j, i in enumerate(row[:cached // b]) if i in gone}
        if at:
            m._evicted.setdefault(rid, set()).update(at)


def estimate_cached(m: KVCacheManager, request_id: str) -> int:
    """``m.estimate_cached_tokens`` (its contract is there) of the request ``request_id``."""
    n = m.num_cached_tokens(request_id)
    evicted = m._evicted.get(request_id, ())
    if not n or not (evicted or m._hybrid):  # (a window's released blocks: null)
        return n
    return min(  # (each group at its own block size; an uncached window's not counted, as vLLM's)
        b * max((j + 1 for j, i in enumerate(row[:n // b]) if i and (g, j) not in evicted), default=0)
        for g, (row, b) in enumerate(zip(m.get_block_ids(request_id), m.group_sizes, strict=True))
        if m.cached_groups[g])
