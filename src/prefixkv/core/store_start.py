"""``add_request``'s store start (``_start``: a function ``KVCacheManager``'s body lists,
``self`` the manager, whose state ``admission.construct`` sets).

The common case of an admission with a shared store: a ``Prompt`` this manager
prepared (no multimodal keys), every other argument its default, a new id that no fetch
waits for. The general path (``admit_general._admit``) then checks no argument, asks
for no fetch (``StoreWaits.take``), finds the prefix without a claim (a store's
admission walks: ``_find``) and hands what it found to ``StoreWaits.start``; here that
is one function, in its order, with the same effects: the request made as
``new_request`` makes it, the walk, the start. A start that answers None (not worth
it, no slot, the executor refused) goes on as ``_admit`` does after it (``_admit``
given what was found). tests/store/test_start_path.py runs both on the same states.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from ..results import Admission, StoreWait
from .prompt import Prompt
from .request import GROW_AT, Request, grow_room

if TYPE_CHECKING:
    from .manager import KVCacheManager


def _start(self: KVCacheManager, request_id: Hashable, p: Prompt) -> Admission | StoreWait | None:
    """``add_request(request_id, p)`` with every other argument its default, for a
    ``Prompt`` this manager prepared with no multimodal keys and no more tokens than the
    pool has slots, and an id that no live request has and no fetch waits for
    (``add_request`` checked all that): the same answer, effects and raises as
    ``_admit``'s."""
    for tokens in p.spare:  # noqa: B007 (the copy ``prepare`` made: ``_find``)
        break
    else:
        tokens = p.tokens[:]
        if len(tokens) >= GROW_AT:
            grow_room(tokens)
    keys, chunks = p.keys, p.chunks
    req = Request()  # (``new_request``, inline, and what ``_find`` adds)
    req.request_id, req.tokens, req.keys = request_id, tokens, keys
    req.blocks = []
    req.num_cached = req.num_scheduled = req.num_reserved = 0
    req.prompt_chunks, req.prompt, req.prompt_hashes = chunks, p, p.hashes
    # the hits: every block but the one holding the last token (``hit_limit``)
    limit = (len(tokens) - 1) // self.block_size
    hits = self._index.match(chunks if limit == len(chunks) else chunks[:limit], keys.base,
                             None)
    if len(hits) < limit:
        wait = self._waits.start(req, hits, chunks, limit, p)  # type: ignore[union-attr]
        if wait is not None:
            return wait
    return self._admit(request_id, p, None, None, False, True, 0, False, 0, None, (req, hits))
