"""The manager's whole-state check (``KVCacheManager.check_invariants``): request counts,
reference counts against every holder (live requests, pending copies, store fetches), the
pool, the copy plan, the host tier and the store's landing slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvariantError

if TYPE_CHECKING:
    from .manager import KVCacheManager


def require(problem: str | None) -> None:
    """Raise InvariantError with this problem, if there is one."""
    if problem:
        raise InvariantError(problem)


def check_invariants(self: KVCacheManager) -> None:
    """Verify every count and link (pool, free queue, index, refcounts against the
    live requests, each request's blocks against its tokens). Raises InvariantError."""
    refs: dict[int, int] = {}
    bs = self.block_size
    prefilling = sum(r.num_scheduled < len(r.tokens) for r in self._requests.values())
    require(None if prefilling == self._num_prefilling else
               f"{prefilling} requests are prefilling, counted {self._num_prefilling}")
    for req in self._requests.values():
        require(req.check(bs) or self._index.check_request(req, bs))
        for b in req.blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in self._copies.pins + [b for held in self._copies.kept for b in held]:
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in self._waits.held.holds() if self._waits is not None else ():  # store fetches'
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    require(self._pool.check(refs))
    require(self._copies.check(self._pool.blocks,
                               self._host.load_dst if self._host is not None else ()))
    if self._host is not None:
        require(self._host.check()
                   or self._host.check_loads(self._pool.blocks)
                   or self._host.check_parents(self._pool.blocks))
    if self._waits is not None:
        landing = self._host.num_landing  # type: ignore[union-attr]
        require(None if landing == self._waits.reserved else
                   f"{landing} host slots are landing, fetches reserved {self._waits.reserved}")
