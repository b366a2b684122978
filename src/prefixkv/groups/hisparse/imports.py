"""External (connector) loads into a HiSparse request's host pages: the imports pending
and the restores in flight of one ``HiSparseState``, and the device pages an import
needs. vLLM 0.33's rules (its ``HiSparseResidentManager`` / ``HiSparseHotManager``
counts and ``HiSparseCoordinator``'s ``record_pending_host_import``,
``finish_host_import``, ``complete_host_import``), checked against
tests/engines/hisparse_import_model.py:

    page:   0 .. tail - 1             | tail                   | tail + 1 ..
    row:    HOST (read from host)     | a GPU page, writable   | the step's new pages
    host:   written by the load       | written by the load, restored to the GPU once done

- A load of ``E`` tokens is the request's first allocation: its host pages, the indexer's
  pages, the row up to its tail page (``tail = (E - 1) // block_size``) of which only the
  tail is on the GPU, and the hot region (the row reads from host).
- While it is pending, no page below the import's end is copied to host (the load
  writes them).
- Done: its whole pages are valid; the tail page's host copy is restored to its GPU page
  before the next forward pass, which makes that page clean only when it is whole.
  Failed: nothing is marked; the request is freed by its caller.

Caller mistakes raise RequestError before any change (the state's calls check them).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ...core.block import blocks_for
from ...errors import InvariantError

__all__ = ["Imports"]


class Imports:
    """The imports of one state. ``pending``: request -> the tokens its load writes, until
    it is finished; ``failed``: the same of the requests whose load failed, until freed;
    ``hits``: request -> the pages of the prefix hit its load follows (hits.py), until
    freed; ``restores``: copy id -> whether the page it restores is whole, while in flight
    (a freed request's too)."""

    __slots__ = ("pending", "failed", "hits", "restores")

    def __init__(self) -> None:
        self.pending: dict[Hashable, int] = {}
        self.failed: dict[Hashable, int] = {}
        self.hits: dict[Hashable, int] = {}
        self.restores: dict[int, bool] = {}

    def first_page(self, key: Hashable, block_size: int) -> int:
        """The first page a step may copy to host, or that holds a valid host copy: past
        ``key``'s pending or failed import (0 without one)."""
        return blocks_for(self.pending.get(key, 0) or self.failed.get(key, 0), block_size)

    def forget(self, key: Hashable) -> None:
        """``key`` was freed: its import goes (its restore in flight stays until confirmed)."""
        self.pending.pop(key, None)
        self.failed.pop(key, None)
        self.hits.pop(key, None)

    @staticmethod
    def row_need(blocks: Sequence[object | None], pages: int, imported: int, block_size: int) -> int:
        """The row's new GPU pages for a step to ``pages`` pages whose computed tokens
        include an import of ``imported`` (vLLM's count): the tail page unless it is on
        the GPU already (``blocks``: the row's, None read from host), then the pages past
        the import and the row. Never capped at the admission window."""
        imported_pages = blocks_for(imported, block_size)
        tail = imported_pages - 1
        needs_tail = tail >= len(blocks) or blocks[tail] is None
        return int(needs_tail) + max(pages - max(imported_pages, len(blocks)), 0)

    def check_invariants(self, in_flight: Sequence[int], live: Sequence[Hashable]) -> None:
        """Raise InvariantError unless every restore is in flight and every pending
        import is a live request's."""
        if not self.restores.keys() <= set(in_flight):
            raise InvariantError(f"restores {sorted(self.restores)} not all in flight")
        if not (self.pending.keys() | self.failed.keys() | self.hits.keys()) <= set(live):
            raise InvariantError(f"imports pending for requests gone: {sorted(map(repr, self.pending))}")
