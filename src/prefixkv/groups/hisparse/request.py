"""One HiSparse request's blocks (``state.HiSparseState``'s record of it)."""

from __future__ import annotations

from ...core.block import Block
from .row import ResidentRow

__all__ = ["_Request"]


class _Request:
    """One request's blocks: its host row, indexer pages, resident row (None: a page the
    pool reused, read from host) and hot region; ``synced``: the row's pages the workers
    were told of (``take_residency``), ``stale`` those of them lost since."""

    __slots__ = ("host", "indexer", "blocks", "row", "hot", "hot_required", "synced", "stale")

    def __init__(self) -> None:
        self.host: list[Block] = []
        self.indexer: list[Block] = []
        self.blocks: list[Block | None] = []
        self.row = ResidentRow()
        self.hot: list[Block] = []
        self.hot_required = False
        self.synced = 0
        self.stale: set[int] = set()
