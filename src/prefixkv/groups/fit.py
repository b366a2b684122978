"""Whether a request can ever fit the hybrid manager's pool: the fewest blocks an
admission with given arguments needs, over every hit it could find, and the fewest its
prompt holds once its prefill is done (``HybridKVCacheManager.add_request`` refuses with
PromptTooLongError what needs more than the pool has, where a ``None`` would mean
"wait" forever).

An admission of ``n`` tokens that finds ``k`` cached blocks holds, in group ``g``, the
hits its window still reads (``k - num_unread_g(k*bs)``) and fresh blocks up to the
scheduled tokens and the lookahead (``blocks_for(total + lookahead) - k``), the same
count in every group (``require_full_fit``: for the whole prompt), but one in a sparse
(Mamba) group, which takes a block for the last position only, and a group's blocks ahead
(``GroupSpec.ahead``) on top. Once the prompt's last
step starts at ``s <= n - 1``, group ``g`` holds at least ``blocks_for(n) -
num_released_g(n - 1)`` (a sparse group: 1; ``num_released``: the window's retained
tokens' blocks kept).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.block import blocks_for
from .spec import GroupSpec


def least_blocks(groups: Sequence[GroupSpec], block_size: int, n: int, num_new: int | None,
                 lookahead: int, full_fit: bool, capacity: int) -> int:
    """The fewest blocks, all groups together, that an admission of ``n`` tokens with
    these arguments (``add_request``'s) and the rest of its prefill need at some point,
    whatever the cache holds. The admission's part is the least over every hit length
    only when it exceeds ``capacity`` (the two extremes are tried first, and when one of
    them fits, that is enough to know). Pure."""
    bs = block_size
    done = sum(1 if s.sparse else blocks_for(n, bs) - s.num_released(n - 1, bs) + s.ahead for s in groups)

    def call(k: int) -> int:  # blocks held right after an admission that hit k blocks
        cached = k * bs
        total = n if num_new is None else min(n, cached + num_new)
        per_group = blocks_for(total + lookahead, bs) - k
        fresh = max(per_group, blocks_for(n, bs) - k) if full_fit else per_group
        return sum(min(fresh, 1) if s.sparse else fresh + s.ahead for s in groups) + sum(
            k - s.num_unread(cached, bs) for s in groups)

    most = (n - 1) // bs  # hit blocks at most: the last token is always computed
    best = min(call(0), call(most))  # the usual extremes: a chunk after no hit, the whole
    if best > capacity:              # prompt after the longest hit; else every length
        best = min([best, *(call(k) for k in range(1, most))])
    return max(done, best)
