"""Mamba's boundary-state hand-offs to a KV connector, as vLLM 0.33's ``MambaManager``
makes them (``take_boundary_state_offloads``, ``finalize_partial_tail_offloads``).

An align-mode Mamba table is not append-only (interior states go back to the pool and
read as the null block), so a connector that offloads Mamba states cannot find them by
position: vLLM's manager names each one, ``(group, block id, boundary tokens)``:

1. every block a Mamba group made findable under a whole-block key (the state at its
   end: ``boundary = (j + 1) * block_size``), in the call that cached it; a chunk-end
   checkpoint kept inside a block (checkpoints.py) with its position instead, in its
   place by position; none a sparse retention leaves uncached;
2. a request's own partial entry at its prompt's last hash boundary inside a Mamba
   block (a *partial tail*, groups/partial.py ``tail``): when its next growth moves the
   entry to a copy (a copy on write), the copy, with that boundary, before what the same
   call caches; if the request finishes first, ``finalize`` names the table's block
   itself, once, when no later token was computed (``num_computed_tokens`` is the
   boundary, none in flight); either consumes it.

Offers wait, per group in call order, until ``take`` drains them (vLLM's scheduler: once
a step), grouped by request: each request's list is group after group. A request that
leaves (``free``, ``pop_blocks_for_free``) takes its waiting offers and partial tail with
it (found gone when they are read: a free costs nothing here). Nothing is held for an
offer: it names a block whose content holds until the step ends (a connector reading
later pins it first), as vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["BoundaryOffers", "hand_tails", "inside", "offer", "tails"]

Offer = tuple[int, int, int]
"""``(group, vLLM block id, boundary tokens)``."""


class BoundaryOffers:
    """The offers not yet taken and the partial tails not yet handed off (module
    docstring), each under the request's id and prefixkv's key of it (one per admission):
    a request that left is found gone when they are read (``take``, ``finalize``), so
    that freeing a request costs nothing here."""

    def __init__(self) -> None:
        # key -> the request id and its offers waiting: (group, serial, block id, boundary tokens)
        self._waiting: dict[int, tuple[str, list[tuple[int, int, int, int]]]] = {}
        self._serial = 0  # (the call order within a group)
        self._tails: dict[int, tuple[str, list[Offer]]] = {}  # key -> the request id and its partial tails

    def add(self, key: int, request_id: str, offers: Iterable[Offer]) -> None:
        """``offers`` of the live request ``request_id`` (``key``), in order, after those
        already waiting."""
        waiting = self._waiting.setdefault(key, (request_id, []))[1]
        for g, block_id, tokens in offers:
            self._serial += 1
            waiting.append((g, self._serial, block_id, tokens))

    def take(self, live: Mapping[Any, int]) -> dict[str, list[Offer]]:
        """The waiting offers of the requests still live (``live``: request id -> key),
        drained: ``{request id: [(group, block id, boundary), ...]}``, group after group,
        each group's in call order; a request appears where its first offer of the
        lowest group is (vLLM's order). The others go, and the tails of requests gone."""
        if self._tails:
            self._tails = {k: t for k, t in self._tails.items() if live.get(t[0]) == k}
        if not self._waiting:
            return {}
        ordered = sorted((g, serial, rid, block_id, tokens) for k, (rid, offers) in self._waiting.items()
                         if live.get(rid) == k for g, serial, block_id, tokens in offers)
        self._waiting = {}
        out: dict[str, list[Offer]] = {}
        for g, _, rid, block_id, tokens in ordered:
            out.setdefault(rid, []).append((g, block_id, tokens))
        return out

    def tail(self, key: int, request_id: str, g: int, block_id: int, tokens: int) -> None:
        """The live request recorded a partial tail of ``tokens`` in its block ``block_id`` of group ``g``."""
        self._tails.setdefault(key, (request_id, []))[1].append((g, block_id, tokens))

    def moved(self, key: int, g: int, copy_id: int) -> Offer | None:
        """The live request's partial tail in group ``g`` moved to ``copy_id``: the offer
        of the copy (the tail consumed), or None when no tail of it is waiting."""
        tails = self._tails[key][1] if key in self._tails else []
        k = next((k for k, t in enumerate(tails) if t[0] == g), None)
        if k is None:
            return None
        tokens = tails.pop(k)[2]
        if not tails:
            del self._tails[key]
        return g, copy_id, tokens

    def finalize(self, request: Any, key: int | None) -> list[Offer]:
        """The partial tails of ``request`` (live as ``key``; None: gone, it has none),
        consumed: each one's table block and boundary when the request computed exactly
        up to it and has none in flight, else none."""
        tails = self._tails.pop(key, ("", []))[1] if key is not None and self._tails else []
        return sorted(t for t in tails if not request.num_in_flight_tokens
                      and request.num_computed_tokens == t[2])


def offer(m: KVCacheManager, request: Any, noted: Sequence[tuple[int, int, int]],
          kept: Sequence[Offer] = ()) -> None:
    """Offer what a call on ``request`` cached: the blocks ``noted`` (``StepCache.note``'s
    ``(group, block index, block id)``: each holds the state at its end) and the
    checkpoints ``kept`` inside a block (offers), each group's by position."""
    if noted or kept:
        sizes = m.group_sizes
        got = [(g, i, (j + 1) * sizes[g]) for g, j, i in noted]
        m._mamba.offers.add(m._keys[request.request_id], request.request_id,
                            sorted(got + list(kept), key=lambda o: (o[0], o[2])) if kept else got)


def inside(groups: Sequence[int], ids: Sequence[Sequence[int]], kept: Sequence[Sequence[int]],
           c: int) -> list[Offer]:
    """The checkpoints a step kept inside a block at ``c`` (checkpoints.py ``inner``,
    which took them out of the tables ``ids``, giving ``kept``), offered at ``c``."""
    return [(g, x, c) for g in groups for x, y in zip(ids[g], kept[g], strict=True) if x != y]


def tails(m: KVCacheManager, key: int) -> list[tuple[int, int]]:
    """The partial tails the request ``key`` owns in Mamba groups: ``(group, prefixkv's
    block id)``, the entries its next growth moves to a copy (groups/partial.py)."""
    return [(g, x) for g, x in m.core.owned_entries(key) if g in m._mamba.groups]


def hand_tails(m: KVCacheManager, request: Any, key: int, owned: list[tuple[int, int]], after: int) -> None:
    """After a call on the live ``request`` (``key``), which owned the tails ``owned``
    before and has computed ``after`` tokens: each tail it no longer owns moved to a
    copy (offered, the copy found among the queued copies, which go on to the manager's
    own queue unchanged); each new one is its own tail at ``after``."""
    now, offers, k = tails(m, key), m._mamba.offers, m._blocks.offset
    gone = [t for t in owned if t not in now]
    if gone:
        ops = m.core.take_kv_ops()
        m._copies.queued += ops
        for g, x in gone:
            dst = next((op.dst for op in reversed(ops) if op.group_idx == g and op.src == x), None)
            assert dst is not None, f"the partial entry of block {x} in group {g} left with no copy queued"
            if (moved := offers.moved(key, g, dst + k)) is not None:
                offers.add(key, request.request_id, [moved])
    for g, x in now:
        if (g, x) not in owned:
            offers.tail(key, request.request_id, g, x + k, after)
