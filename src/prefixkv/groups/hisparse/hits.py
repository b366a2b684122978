"""Hits on a HiSparse layout with prefix caching (``cache.HiSparseCache``'s ``lookup``,
``need_hit`` and ``admit``): the longest prefix both the host pool's published pages and
the indexer's cached device pages hold, what admitting a new request with it takes, and
the admission. The rules are vLLM 0.33's (its ``HiSparseSourceManager``,
``HiSparseResidentManager``, ``HiSparseHotManager`` counts and ``commit_computed_blocks``):

    page:   0 .. k - 1          | k .. tail - 1           | tail            | tail + 1 ..
    row:    HOST (the hit)      | HOST (the load writes)  | a GPU page      | new pages
    host:   the hit's blocks, and past them up to the import's pages | new blocks

- A hit of ``k`` pages: the first ``k`` host and indexer blocks; the row starts with ``k``
  HOST pages (valid, their GPU copies adopted at the first step) and the hot region is
  taken.
- An external (connector) load after the hit (``imported``: the hit's and the load's
  tokens) keeps the host hit up to the import's pages (vLLM's source group retains the
  longer hit: those pages are the hit's published blocks, not new ones); pages ``k`` to
  the import's end are written by the load (imports.py: read from host, the last one
  restored once done); nothing below the import's end is published or copied to host
  while it is pending.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ...core.block import Block, blocks_for
from ...errors import RequestError, check_count
from .imports import Imports
from .request import _Request

if TYPE_CHECKING:
    from .cache import HiSparseCache

__all__ = ["admit", "lookup", "need_hit"]


def lookup(state: HiSparseCache, hashes: Sequence[bytes], max_tokens: int) -> tuple[list[Block], list[Block]]:
    """``HiSparseCache.lookup``."""
    n = min(check_count("max_tokens", max_tokens, 0, None) // state.block_size, len(hashes))
    host, index = [], state._index("host")
    for h in hashes[:n]:
        b = index.find(h)
        if b is None:
            break
        host.append(b)
    indexer, index = [], state._index("device")
    for h in hashes[:len(host)]:
        b = index.find(h)
        if b is None:
            break
        indexer.append(b)
    return host, indexer


def _kept(state: HiSparseCache, host: Sequence[Block], k: int, imported: int) -> Sequence[Block]:
    """The host hit a request keeps: its ``k`` pages, or up to the import's pages."""
    return host[:blocks_for(imported, state.block_size)] if imported else host[:k]


def need_hit(state: HiSparseCache, tokens: int, host: Sequence[Block], indexer: Sequence[Block], *,
             cap: bool = False, imported: int = 0) -> int:
    """``HiSparseCache.need_hit``."""
    k, bs = len(indexer), state.block_size
    pages = blocks_for(check_count("tokens", tokens, 1, None), bs)
    kept = _kept(state, host, k, imported)
    if imported:  # (an import's row count: never capped at the admission window)
        row = Imports.row_need([None] * k, pages, imported, bs)
    else:
        row = max((min(pages, state.window) if cap else pages) - k, 0)
    n = max(pages - k, 0) + sum(not b.refs for b in indexer) + row + state.hot_blocks
    host_need = max(pages - len(kept), 0) + sum(not b.refs for b in kept)
    return n + (len(state.device.blocks) + 1 if host_need > state.host.num_free else 0)


def admit(state: HiSparseCache, key: Hashable, total: int, hashes: Sequence[bytes], host: Sequence[Block],
          indexer: Sequence[Block], imported: int = 0) -> bool:
    """``HiSparseCache.admit``."""
    k, bs = len(indexer), state.block_size
    if not k or state.holds(key) or len(host) < k:
        raise RequestError(f"a hit for {key!r}: a new request, its host hit as long as its indexer's")
    if imported:
        check_count("imported", imported, k * bs + 1, None)
        check_count("total", total, imported, None)
    if state.need_hit(total, host, indexer, imported=imported) > state.device.num_free:
        return False
    kept = _kept(state, host, k, imported)
    r = state._requests[key] = _Request()
    r.host = state.host.acquire(list(kept), 0)
    r.indexer = state.device.acquire(list(indexer), 0)
    r.blocks = [None] * k
    r.row.start_host(k)
    if imported:  # (vLLM's order: the import's host, indexer, then tail pages)
        pages = blocks_for(imported, bs)
        r.host += state.host.take(pages - len(r.host))
        r.indexer += state.device.take(pages - k)
        r.blocks += [None] * (pages - 1 - k)
        r.blocks += state.device.take(1)
        r.row.pad(pages - 1 - k)
        r.row.grow(1)
        state.imports.pending[key] = imported
        state.imports.hits[key] = k
    r.hot_required = True
    state._hit(key, hashes, len(kept), k)
    got = state.allocate(key, total)
    assert got, "HiSparse blocks short after the hit's count"
    return True
