"""The tokens a rewound request must give again: those its forgotten positions held in
blocks another request still shares (a fork sibling, a hit on its prefix). The request
rewrites its KV in place, and the other request reads those blocks: different tokens there
would give it KV computed for other tokens. ``HybridKVCacheManager.rewind`` pins them;
``append_tokens`` / ``append_step`` check new tokens against them before any change.

    | kept | pinned: the old tokens, up to the end of the last shared block | free |
    0   num_tokens (rewound to)                                        end

A token changes the KV of every position after it: a pinned position takes another token
only when no block from its own on is shared any more.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Mapping

from ..errors import RequestError
from .request import GroupRequest


class _Pin:
    __slots__ = ("req", "start", "tokens")

    def __init__(self, req: GroupRequest, start: int, tokens: array[int]) -> None:
        self.req, self.start, self.tokens = req, start, tokens

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _shared(req: GroupRequest, j: int) -> bool:
    """Whether another request holds request ``req``'s block ``j`` in some group."""
    return any(j < len(t) and (b := t[j]) is not None and b.ref_cnt > 1 for t in req.tables)


class RewindPins:
    """The pins of one manager's rewound requests, by request id. A pin whose request
    is no longer the live one of its id (freed, the id reused) is dropped when met."""

    __slots__ = ("_pins",)

    def __init__(self) -> None:
        self._pins: dict[Hashable, _Pin] = {}

    def __bool__(self) -> bool:
        return bool(self._pins)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._pins

    def rewind(self, req: GroupRequest, num_tokens: int, block_size: int,
               live: Mapping[Hashable, GroupRequest]) -> None:
        """Pin what ``req`` forgets when rewound to ``num_tokens`` (call it before the
        rewind changes anything): its tokens from there to the end of its last block
        another request shares, with what an earlier pin still holds past its scheduled
        tokens. Also drops the pins of requests no longer live."""
        pins, rid = self._pins, req.request_id
        for other in [k for k, p in pins.items() if live.get(k) is not p.req]:
            del pins[other]
        old = pins.pop(rid, None)
        n = req.num_scheduled
        if old is not None and old.end <= n:
            old = None  # (the request is past it; else what it pins past n is still owed)
        end = num_tokens if old is None else old.end
        last = next((j for j in range(n // block_size - 1, num_tokens // block_size - 1, -1)
                     if _shared(req, j)), None)  # (the last full block another holds)
        if last is not None:
            end = max(end, (last + 1) * block_size)
        if end > num_tokens:
            known = req.tokens[num_tokens:n]
            if old is not None:
                known += old.tokens[n - old.start:]
            pins[rid] = _Pin(req, num_tokens, known[:end - num_tokens])

    def check(self, req: GroupRequest, new: array[int], block_size: int) -> None:
        """Raise RequestError when ``new``, scheduled from ``req.num_scheduled`` on,
        differs from a pinned token at or before a block another request still shares
        (a token changes the KV of every position after it). Changes nothing (but drops
        a pin ``req`` is past, or one of a request no longer live)."""
        rid, n = req.request_id, req.num_scheduled
        pin = self._pins.get(rid)
        if pin is None:
            return
        if pin.req is not req or n >= pin.end:
            del self._pins[rid]
            return
        first, stop = max(n, pin.start), min(n + len(new), pin.end)
        for p in range(first, stop):
            was, got = pin.tokens[p - pin.start], new[p - n]
            if was == got:
                continue
            shared = [j for j in range(p // block_size, pin.end // block_size) if _shared(req, j)]
            if shared:
                raise RequestError(
                    f"request {rid!r}: token {got} at position {p} (it held {was} before "
                    f"its rewind) would change the KV of block {shared[-1]}, which another "
                    f"request shares: give the same tokens again, or free or preempt the "
                    f"other request first")
            return  # (no block from there on is shared: the rest is free)
