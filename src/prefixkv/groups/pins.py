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
from collections.abc import Hashable, Mapping, Sequence

from ..core.block import Block
from ..errors import RequestError
from .request import GroupRequest


class _Pin:
    __slots__ = ("req", "start", "tokens")

    def __init__(self, req: GroupRequest, start: int, tokens: array[int]) -> None:
        self.req, self.start, self.tokens = req, start, tokens

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _shared(table: Sequence[Block | None], j: int) -> bool:
    """Whether another request holds block ``j`` of a request's group ``table``."""
    return j < len(table) and (b := table[j]) is not None and b.ref_cnt > 1


def _shared_end(req: GroupRequest, lo: int, hi: int, sizes: Sequence[int]) -> int:
    """The end of the last block another request holds, over the groups (each at its
    own size ``sizes[g]``), among those holding a position in ``[lo, hi)`` but the
    last partial one; ``lo`` when none."""
    end = lo
    for t, b in zip(req.tables, sizes, strict=True):
        last = next((j for j in range(hi // b - 1, lo // b - 1, -1) if _shared(t, j)), None)
        if last is not None:
            end = max(end, (last + 1) * b)
    return end


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

    def rewind(self, req: GroupRequest, num_tokens: int, sizes: Sequence[int],
               live: Mapping[Hashable, GroupRequest]) -> None:
        """Pin what ``req`` forgets when rewound to ``num_tokens`` (call it before the
        rewind changes anything): its tokens from there to the end of its last block
        another request shares (``sizes``: each group's block size), with what an
        earlier pin still holds past its scheduled tokens. Also drops the pins of
        requests no longer live."""
        pins, rid = self._pins, req.request_id
        for other in [k for k, p in pins.items() if live.get(k) is not p.req]:
            del pins[other]
        old = pins.pop(rid, None)
        n = req.num_scheduled
        if old is not None and old.end <= n:
            old = None  # (the request is past it; else what it pins past n is still owed)
        end = max(num_tokens if old is None else old.end, _shared_end(req, num_tokens, n, sizes))
        if end > num_tokens:
            known = req.tokens[num_tokens:n]
            if old is not None:
                known += old.tokens[n - old.start:]
            pins[rid] = _Pin(req, num_tokens, known[:end - num_tokens])

    def check(self, req: GroupRequest, new: array[int], sizes: Sequence[int]) -> None:
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
            shared = [(g, j) for g, (t, b) in enumerate(zip(req.tables, sizes, strict=True))
                      for j in range(p // b, pin.end // b) if _shared(t, j)]
            if shared:
                g, j = max(shared, key=lambda gj: (gj[1] + 1) * sizes[gj[0]])
                raise RequestError(
                    f"request {rid!r}: token {got} at position {p} (it held {was} before "
                    f"its rewind) would change the KV of block {j}"
                    f"{f' of group {g}' if len(set(sizes)) > 1 else ''}, which another "
                    f"request shares: give the same tokens again, or free or preempt the "
                    f"other request first")
            return  # (no block from there on is shared: the rest is free)
