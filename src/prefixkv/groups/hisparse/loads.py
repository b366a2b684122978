"""External (connector) loads into a HiSparse state's host pages: ``HiSparseState.load``
and ``finish_import`` (their rules: imports.py's module doc)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ...core.block import blocks_for
from ...errors import RequestError, check_count
from .request import _Request
from .row import DIRTY

if TYPE_CHECKING:
    from .state import HiSparseState

__all__ = ["load", "finish_import"]


def load(state: HiSparseState, key: Hashable, imported: int, total: int, full: int = 0) -> bool:
    """``HiSparseState.load``."""
    if key in state._requests:
        raise RequestError(f"HiSparse request {key!r} holds blocks: a load is its first allocation")
    check_count("imported", imported, 1, None)
    check_count("total", total, imported, None)
    limit = state.device.num_free
    if (full and state.need(key, full, imported=imported) > limit) or state.need(
            key, total, imported=imported) > limit:
        return False
    r = state._requests[key] = _Request()
    imported_pages, pages = blocks_for(imported, state.block_size), blocks_for(total, state.block_size)
    r.host = state.host.take(imported_pages) + state.host.take(pages - imported_pages)
    r.indexer = state.device.take(imported_pages)
    r.blocks = [None] * (imported_pages - 1) + state.device.take(1)  # (the tail page, writable)
    r.row.pad(imported_pages - 1)
    r.row.grow(1)
    r.indexer += state.device.take(pages - imported_pages)
    r.blocks += state.device.take(pages - imported_pages)
    r.row.grow(pages - imported_pages)
    r.hot_required = True
    r.hot = state.device.take(state.hot_blocks)
    r.row.hold_hot()
    state.imports.pending[key] = imported
    return True


def finish_import(state: HiSparseState, key: Hashable, failed: bool) -> None:
    """``HiSparseState.finish_import``."""
    imported = state.imports.pending.pop(key, None)
    if imported is None:
        return
    if failed:
        state.imports.failed[key] = imported
        return
    r = state._requests[key]
    tail = (imported - 1) // state.block_size
    if r.row.state(tail) == DIRTY and r.blocks[tail] is not None:
        r.row.restore(tail)
        tid, = state.spills.plan(key, [tail], budgeted=False)
        state.imports.restores[tid] = tail < imported // state.block_size
