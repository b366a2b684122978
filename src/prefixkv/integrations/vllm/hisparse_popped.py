"""``pop_blocks_for_free`` of a HiSparse manager (vLLM 0.33's: the request's bookkeeping
goes, its blocks are handed to the caller, which gives them back later through
``block_pool.free_blocks``, host blocks among them going to the host pool). Served for
a request whose resident pages are all dirty (no copy to host planned, in flight or
confirmed, none read from host: its row is all its own GPU pages) and with no import
pending: its blocks, in vLLM's order (source, indexer, resident row, hot region), stay
held by the caller (the pools' views count them taken, as another user's) until given
back, so nothing of it is reused before then. Refused by name (UnsupportedByPrefixKV,
nothing changed) for any other request: a copy in flight must keep its blocks past the
free and vLLM's free unpins clean pages, which the caller's later free would count
again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from prefixkv.groups.hisparse.row import DIRTY

from .hisparse_groups import HOST, DevicePoolView, refused

if TYPE_CHECKING:
    from .hisparse_manager import HiSparseKVCacheManager

__all__ = ["pop_for_free"]


def pop_for_free(manager: HiSparseKVCacheManager, request: Request) -> list[KVCacheBlock]:
    """``HiSparseKVCacheManager.pop_blocks_for_free`` (module doc)."""
    rid, state = request.request_id, manager.state
    if rid not in manager._rows:
        return []
    row = state.row(rid)
    imports = state.imports
    ids = manager.get_block_ids(rid)
    device: DevicePoolView = manager.block_pool  # type: ignore[assignment]
    host = manager.host_pool
    taken = any(i in device.taken for g in ids[1:] for i in g) or any(i in host.taken for i in ids[HOST])
    if len(row.pages(DIRTY)) != len(row) or rid in imports.pending or rid in imports.failed or taken:
        refused(f"pop_blocks_for_free of {rid!r}, whose pages are copied, read from host, loaded "
                "or held by another user (only a request of dirty pages alone)")
    blocks = manager.get_blocks(rid).blocks
    views = ((host, state.host, ids[HOST]), (device, state.device, [*ids[1], *ids[2], *ids[3]]))
    for view, pool, group in views:
        held = pool.acquire([pool.blocks[i] for i in group], 0)
        view.taken.update((b.block_id, b) for b in held)
    manager.free(request)
    return [b for g in blocks for b in g]
