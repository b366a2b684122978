"""A hybrid manager's whole-state check (``HybridKVCacheManager.check_invariants``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.manager_check import require
from .free_runs import unfound
from .request import GroupRequest

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def check_invariants(self: HybridKVCacheManager) -> None:
    """Verify every count and link: the pool and free queue, each group's index, the
    prefix-id table and its references, refcounts against the live requests, each
    request's tables against its tokens and its windows. Raises InvariantError."""
    refs: dict[int, int] = {}
    if self._null is not None:
        refs[self._null.block_id] = 1
    node_refs = self._index.node_refs()
    for c in self._held_copies or ():  # (a copy on write holds both ends: groups/partial.py)
        for i in (c.src, c.dst):
            refs[i] = refs.get(i, 0) + 1
    for req in self._requests.values():
        require(self._check_request(req))
        for t in req.tables:
            for b in t:
                if b is not None:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        if req.nodes:
            pid = req.nodes[-1].pid
            node_refs[pid] = node_refs.get(pid, 0) + 1
    require(self._pool.check(refs))
    require(self._table.check(node_refs))


def _check_request(self: HybridKVCacheManager, req: GroupRequest) -> str | None:
    """The first way a request's state is unsound (``GroupRequest.check``, and every
    full-attention group finding its prefix where ``free_runs.unfound`` counts on it)."""
    return req.check(self.groups, self.sizes) or unfound(self._index, req)
