"""``add_request``'s re-admission after a store fetch landed whole on the device
(``_readmit``: a function ``KVCacheManager``'s body lists, ``self`` the manager, whose
state ``admission.construct`` sets).

The common case after ``StoreWait`` and ``poll_store``: the fetch holds the request's
blocks (its device hits, the blocks its host hits went up to at the start, the landed
run: ``Fetch.blocks``) and the one empty block the start took for the tokens after them
(``Fetch.tail``), and nothing moved (``store_reuse.unmoved``: ``reuse``'s answer then). The general path
(``admit_general._admit``) then checks no count, splits no loads and asks the pool for
nothing: the request's hits are every full block but the last token's, so the one
block it needs is the tail, which the fetch holds. What is left of ``_admit`` is here,
in its order, with the same effects; every other case goes to ``_admit`` before
anything changes. tests/store/test_readmit_path.py runs both on the same states.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..results import Admission, StoreWait, admission_of
from ..store.fetch import Fetch
from .prompt import Prompt
from .store_reuse import unmoved

if TYPE_CHECKING:
    from .manager import KVCacheManager


def _readmit(self: KVCacheManager, request_id: Hashable, prompt: Sequence[int] | Prompt,
             f: Fetch) -> Admission | StoreWait | None:
    """``add_request(request_id, prompt)`` with every other argument its default, for
    an id no live request has, whose wait is on fetch ``f`` of this manager's store,
    landed whole on the device and held (``Fetch.blocks``; ``add_request`` checked all
    that): the same answer, effects and raises as ``_admit``'s."""
    req, hits = f.req, f.blocks
    assert hits is not None, "a short re-admission of a fetch that holds no blocks"
    n, bs = len(req.tokens), self.block_size
    if not unmoved(f, n, self._index, bs):  # (``reuse``'s answer: None)
        return self._admit(request_id, prompt, None, None, False, True, 0, False, 0, None)
    if n > self._max_slots:  # (as ``_admit``: never for the start's prompt)
        self._check_fits(n, None, 0, False)
    # | hits: every full block but the last token's | the tail: the last token's block |
    num_cached = len(hits) * bs  # (``unmoved``: (n - 1) // bs blocks)
    first = len(hits)
    # the tail is a full block (``_admit``'s ``last > first``): its content is recorded
    prepared = (self._index.prepare(req, first, first + 1, hits[-1])
                if num_cached + bs == n else None)
    (tail,) = f.tail  # (``spare``, ``tail``: the one block needed, the fetch's)
    hits.append(tail)  # (room for it: made by the fetcher, ``fetch_ready``)
    f.tail = []
    req.blocks = hits
    req.num_cached = num_cached
    req.num_scheduled = req.num_reserved = n
    if prepared is not None:
        self._index.store(req, first, prepared)
    req.prompt = req.prompt_chunks = req.prompt_hashes = None
    self._requests[request_id] = req
    self._waits.cancel(request_id, True)  # type: ignore[union-attr]  # (the wait is over)
    stats = self._stats  # (``StatsCounter.record``: its host loads went up at the start)
    stats.requests += 1
    stats.queries += n
    stats.hits += num_cached
    stats.host_hits += f.promoted * bs
    stats.store_hits += len(f.cids) * bs
    return admission_of(request_id, hits, num_cached, n - num_cached)
