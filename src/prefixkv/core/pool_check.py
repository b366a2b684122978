"""The block pool's invariant check (``BlockPool.check``, called by
``check_invariants``): each block in at most one free tier and sound there, the cached
tier's links, every reference count against its holders, then the index's own check.
Read-only; run by tests and by engines that verify their state, never on a step's path.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from .block import Block
from .free_queue import FreeBlockQueue
from .pool_release import PoolIndex


def check_pool(blocks: Sequence[Block], empty: Sequence[Block], cached: FreeBlockQueue,
               num_free: int, index: PoolIndex, expected_refs: dict[int, int],
               unpinned: Container[int] = ()) -> str | None:
    """The first inconsistency of a pool of ``blocks`` whose empty tier is ``empty`` and
    cached tier ``cached`` (``num_free`` counted free in all) against ``expected_refs``
    (block id -> number of live requests holding it), then ``index.check``'s; None when
    sound. ``unpinned``: the ids of cached-tier blocks that hold no content by design
    (``UnpinPool``). Cheap when sound: messages are built only for what is wrong."""
    seen: set[int] = set()
    for b in empty:
        if b.block_id in seen or b.ref_cnt or b.key is not None:
            return f"bad or repeated empty-tier block {b!r}"
        seen.add(b.block_id)
    for b in cached:  # (a pending run's blocks have no key yet: ``Run``)
        if b.block_id in seen or b.ref_cnt or b.twin or (b.key is None and (
                b.counted is None or not b.counted.pending) and b.block_id not in unpinned):
            return f"bad or repeated cached-tier block {b!r}"
        seen.add(b.block_id)
    broken = cached.broken_link()
    if broken:
        return broken
    get = expected_refs.get
    for b in blocks:
        if b.ref_cnt != get(b.block_id, 0) or (b.ref_cnt == 0) != (b.block_id in seen):
            return (f"block {b.block_id}: ref_cnt {b.ref_cnt}, held by "
                    f"{get(b.block_id, 0)} requests, {'in' if b.block_id in seen else 'not in'}"
                    f" the free queue")
    if len(seen) != num_free:
        return f"free queue holds {len(seen)} != num_free {num_free}"
    return index.check(blocks)
