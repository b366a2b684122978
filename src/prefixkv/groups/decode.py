"""The calls that grow a hybrid manager's running requests: prefill chunks, decoded tokens
(one request, or a whole decode step in one call), slots reserved before their tokens are
known, window releases asked for by name, and ``rewind``: functions
``HybridKVCacheManager``'s body lists (``self`` the manager); admission is in
admission.py, the mechanism these calls share (window release, table growth, recording)
in growth.py.

Every group's table covers ``[0, max(num_scheduled, num_reserved))``; a sparse (Mamba)
group's new entries are empty but the last (``GroupSpec.sparse``). A step that starts at
``s`` first releases, in each windowed group, the leading blocks no query at or after ``s``
reads; blocks it releases count as free for the step's own allocation.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..core.block import blocks_for
from ..core.request import step_requests
from ..errors import RequestError, check_chunk, check_count
from .growth import Growth
from .pins import RewindPins
from .request import GroupRequest
from .results import GroupDecodeStep
from .taint import reads_lost, sharers, taint

__all__ = ["Growth"]

if TYPE_CHECKING:
    from .manager import HybridKVCacheManager


def _step_requests(self: HybridKVCacheManager, request_ids: Sequence[Hashable],
                   token_ids: Sequence[int]) -> list[GroupRequest]:
    """The core's checks of a step's requests (known, distinct, prefill done)."""
    return step_requests(self._requests, self._get, self._num_prefilling, request_ids, token_ids)


def extend(self: HybridKVCacheManager, request_id: Hashable, num_new_tokens: int) -> Growth | None:
    """Schedule the next ``num_new_tokens`` known tokens (the next prefill chunk).
    Returns the ids of blocks added, per group, or None on shortage (nothing
    changed). Raises RequestError (unknown id, a count outside 1..unscheduled)."""
    req = self._get(request_id)
    check_chunk(request_id, num_new_tokens, len(req.tokens) - req.num_scheduled)
    return self._grow(req, req.num_scheduled + num_new_tokens, None)


def append_tokens(self: HybridKVCacheManager,
                  request_id: Hashable, token_ids: Sequence[int]) -> Growth | None:
    """Append sampled tokens and schedule them (decode). Returns the ids of blocks
    added, per group, or None on shortage (nothing changed). Raises RequestError
    (unknown id, prefill not fully scheduled, a token unlike the one a ``rewind``
    forgot in a block another request shares), TokenError (bad ids or container)."""
    req = self._get(request_id)
    n = req.num_scheduled
    if n != len(req.tokens):
        raise RequestError(
            f"request {request_id!r} has {len(req.tokens) - n} prompt "
            f"tokens not yet scheduled: call extend() before append_tokens()")
    pins = self._pins
    if pins and request_id in pins:
        pins.check(req, self._step_encode(token_ids), self._group_sizes)
    if type(token_ids) is list and len(token_ids) == 1 and self._roomy(req) \
            and self.vocab_size is None and type(token_ids[0]) is int:
        # the hot path: one token into a block that has room and does not fill, and no
        # window moves past a block
        try:
            req.tokens.append(token_ids[0])  # validates the range, atomically
        except OverflowError:
            self._step_encode(token_ids)  # raises the TokenError
        req.num_scheduled = n + 1
        if n > req.step_start:  # (after a rewind it may lie past n: what was released stays)
            req.step_start = n
        return self._nothing
    new = self._step_encode(token_ids)
    return self._grow(req, req.num_scheduled + len(new), new)


def append_step(self: HybridKVCacheManager, request_ids: Sequence[Hashable],
                token_ids: Sequence[int]) -> GroupDecodeStep:
    """One decode step: append ``token_ids[i]`` to ``request_ids[i]`` for every
    running request, in one call. Each request is handled as ``append_tokens`` with
    one token (windows release first); requests that need new blocks and cannot get
    them (in the order given, earlier ones first) are left unchanged and listed in
    ``short``. Raises (before any change) RequestError (unknown or repeated id,
    lengths differ, prefill not fully scheduled, a token ``append_tokens`` refuses
    after a ``rewind``), TokenError (bad ids), ConfigError (a hash_mode callable
    failed on a block this step fills)."""
    reqs = self._step_requests(request_ids, token_ids)
    new = self._step_encode(token_ids)
    pins = self._pins
    if pins:
        for i, req in enumerate(reqs):
            if req.request_id in pins:
                pins.check(req, new[i:i + 1], self._group_sizes)
    fills = self._prepare_fills(reqs, new)
    grown: list[tuple[Hashable, Growth]] = []
    short: list[Hashable] = []
    for i, req in enumerate(reqs):
        n = req.num_scheduled
        if self._roomy(req):
            req.tokens.append(new[i])
            req.num_scheduled = n + 1
            if n > req.step_start:  # (as in append_tokens)
                req.step_start = n
            continue
        added = self._grow(req, n + 1, new[i:i + 1], fills.get(id(req)))
        if added is None:
            short.append(req.request_id)
        elif any(added):
            grown.append((req.request_id, added))
    return GroupDecodeStep(tuple(grown), tuple(short))


def reserve(self: HybridKVCacheManager, request_id: Hashable, num_slots: int) -> Growth | None:
    """Make every group's table cover ``num_slots`` positions past the scheduled
    tokens, whose tokens are not known yet (speculative lookahead; a step scheduled
    before its sampled token arrives). Appending those tokens later needs no new
    block (a sparse, Mamba, group takes its block at the last reserved position, as
    a step's end: a step that then ends short of it takes one where it ends).
    Releases nothing (windows move when tokens are scheduled). Returns the ids
    of blocks added, per group, or None on shortage (nothing changed). Raises
    RequestError (unknown id, ``num_slots`` < 0)."""
    req = self._get(request_id)
    check_count("num_slots", num_slots, 0, None)
    covered = req.num_scheduled + num_slots
    per_group = blocks_for(covered, self.block_size) - len(req.tables[0]) + self._ahead0
    if self._num_fresh(per_group) > self._pool.num_free:
        return None
    added = self._take(req, per_group) if per_group > 0 else self._nothing
    req.num_reserved = max(req.num_reserved, covered)
    return added


def num_blocks_to_allocate(self: HybridKVCacheManager, request_id: Hashable, num_slots: int) -> int:
    """Free blocks that a step scheduling known tokens from ``num_scheduled_tokens``
    on (``extend`` / ``append_tokens``), then covering ``num_slots`` positions in all
    (``reserve``), takes from the pool, net of the blocks its window release returns
    (0 when it needs none). Changes nothing. Raises RequestError (unknown id,
    ``num_slots`` < 0)."""
    req = self._get(request_id)
    check_count("num_slots", num_slots, 0, None)
    per_group = blocks_for(num_slots, self.block_size) - len(req.tables[0]) + self._ahead0
    return max(0, self._num_fresh(per_group) - self._going(req, req.num_scheduled)[1])


def release_unread(self: HybridKVCacheManager, request_id: Hashable) -> int:
    """Release now, in every windowed group, the blocks that the request's next step
    (at ``num_scheduled_tokens``) would release first: vLLM's ``allocate_slots``
    frees them even when it then refuses the step. Call it only when the request's
    last step ran. Returns how many went back to the pool (held by no other).
    Raises RequestError (unknown id)."""
    req = self._get(request_id)
    going, freed = self._going(req, req.num_scheduled)
    if going is not None:
        self._release(req, going)
        req.step_start = max(req.step_start, req.num_scheduled)
    return freed


def bound_release(self: HybridKVCacheManager, request_id: Hashable, num_tokens: int | None) -> None:
    """From now on, release windows' blocks as if each step started at most at
    ``num_tokens``: keep what a query there still reads (a step the engine scheduled
    but has not run yet, e.g. vLLM's async scheduling, whose steps in flight start
    there). None lifts the bound. Releases nothing. Raises RequestError (unknown id,
    ``num_tokens`` < 0)."""
    req = self._get(request_id)
    if num_tokens is not None:
        check_count("num_tokens", num_tokens, 0, None)
    req.release_bound = num_tokens


def rewind(self: HybridKVCacheManager, request_id: Hashable, num_tokens: int) -> None:
    """Take the request back to its first ``num_tokens`` tokens, all scheduled: the
    engine recomputes from there (the KV after it turned out invalid, e.g. a failed
    load; vLLM's scheduler then sets its computed tokens back). The tokens after it
    are forgotten: give them again with ``append_tokens``, in the step that
    recomputes them, so that the windows move at its start. The request's full
    blocks after it lose their content (its KV is rewritten in place: while another
    request shares one, ``append_tokens`` / ``append_step`` refuse tokens unlike
    those it held there) and stay in the tables as
    reserved slots; they are cached anew as the tokens come back. What the windows
    released stays released, as vLLM's null entries do, even where a query at
    ``num_tokens`` reads it (vLLM's scheduler sets a one-group windowed model back
    there too; the recompute reads null entries): the KV recomputed from there is
    then never cached (it was computed over lost KV: groups/taint.py), nor that of
    another request which shares a block the recompute rewrites, from the first
    position rewritten there on (its cached blocks from there lose their content).
    So too when the request is tainted already: its recompute writes lost KV again,
    from where it was tainted (or ``num_tokens``, if later) on.
    Raises RequestError (unknown id, ``num_tokens`` outside ``[0,
    num_scheduled_tokens]``)."""
    req = self._get(request_id)
    check_count("num_tokens", num_tokens, 0, req.num_scheduled)
    if self._pins is None:
        self._pins = RewindPins()
    self._pins.rewind(req, num_tokens, self._group_sizes, self._requests)
    full = num_tokens // self.block_size
    lost, was = reads_lost(self.groups, req, num_tokens, self._group_sizes), req.tainted_from
    if lost or was is not None:  # (a tainted request recomputes lost KV from ``was`` on)
        start = num_tokens if lost or was is None else max(num_tokens, was)
        for other, first in sharers(req, start, self._requests.values(), self.block_size):
            self._pool.emptied(self._index.uncache(
                [b for t in other.tables
                 for b in t[first // self.block_size:len(other.nodes)] if b is not None]))
            taint(other, first)
        taint(req, start)
    if full < len(req.nodes):
        self._pool.emptied(self._index.uncache(
            [b for t in req.tables for b in t[full:len(req.nodes)] if b is not None]))
    set_back(self, req, num_tokens, full, self.block_size)


def set_back(self: HybridKVCacheManager, req: GroupRequest, num_tokens: int, full: int, unit: int) -> None:
    """A rewind's last part, its blocks' content settled: the request's prefix ids cut
    to the first ``full`` (of ``unit`` tokens each; its hold moves to the last), its
    tokens from ``num_tokens`` forgotten, its counts set back."""
    if full < len(req.nodes):
        old = req.nodes[-1]
        del req.nodes[full:]
        self._table.hold(req.nodes[-1] if req.nodes else None)
        self._table.unhold(old)
    if num_tokens < len(req.tokens):
        del req.tokens[num_tokens:]
        req.prompt = None  # (no longer the request's tokens)
    req.num_reserved = max(req.num_reserved, req.num_scheduled)
    req.num_scheduled = num_tokens
    req.num_cached = min(req.num_cached, full * unit)
    req.next_release = 0  # (its next step takes the general path)


def num_blocks_released(self: HybridKVCacheManager, request_id: Hashable) -> int:
    """Blocks that the window release of the request's next step (at
    ``num_scheduled_tokens``) returns to the pool: those no other request holds (0
    when no window moves past a block). Changes nothing. Raises RequestError
    (unknown id)."""
    req = self._get(request_id)
    return self._going(req, req.num_scheduled)[1]
