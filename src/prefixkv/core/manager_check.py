"""The manager's whole-state check (``KVCacheManager.check_invariants``): request counts,
reference counts against every holder (live requests, pending copies, store fetches), the
pool, the copy plan, the host tier and the store's landing slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .manager import KVCacheManager


def check_manager(m: KVCacheManager) -> None:
    """Raise InvariantError at the first count or link that does not hold."""
    refs: dict[int, int] = {}
    bs = m.block_size
    prefilling = sum(r.num_scheduled < len(r.tokens) for r in m._requests.values())
    m._require(None if prefilling == m._num_prefilling else
               f"{prefilling} requests are prefilling, counted {m._num_prefilling}")
    for req in m._requests.values():
        m._require(req.check(bs) or m._index.check_request(req, bs))
        for b in req.blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in m._copies.pins + [b for held in m._copies.kept for b in held]:
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in m._waits.holds() if m._waits is not None else ():  # store fetches'
        refs[b.block_id] = refs.get(b.block_id, 0) + 1
    m._require(m._pool.check(refs))
    m._require(m._copies.check(m._pool.blocks,
                               m._host.load_dst if m._host is not None else ()))
    if m._host is not None:
        m._require(m._host.check()
                   or m._host.check_loads(m._pool.blocks))
    if m._waits is not None:
        landing = m._host.num_landing  # type: ignore[union-attr]
        m._require(None if landing == m._waits.reserved else
                   f"{landing} host slots are landing, fetches reserved {m._waits.reserved}")
