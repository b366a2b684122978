"""The block pool's release: references dropped, blocks joining the free queue (the empty
tier, or the cached tier in LRU order, a shared run as one segment), spares giving their
place to the block that holds their content. ``BlockPool`` (``core/pool.py``) extends
``PoolRelease``; ``PoolIndex`` is what the pool asks of an index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any, Protocol

from .block import Block
from .free_queue import FreeBlockQueue
from .keyless import Keyless
from .run import RunCounts


class PoolIndex(Protocol):
    """What the pool asks of an index: the eviction step, spares, reset and checks
    (``index.Index`` and the groups' ``GroupIndex`` both satisfy it)."""

    def drop(self, blocks: Sequence[Block], skip: Sequence[tuple[int, int]] = (),
             keyless: Keyless | None = None) -> None: ...
    def drop_one(self, block: Block) -> None: ...
    def release_spare(self, block: Block) -> Block | None: ...
    def clear(self) -> None: ...
    def check(self, blocks: Sequence[Block]) -> str | None: ...


class PoolRelease:
    """``BlockPool``'s release path (its fields are the pool's: ``core/pool.py``)."""

    index: PoolIndex
    runs: RunCounts
    _empty: list[Block]  # the empty tier is ``_empty[_lo:]``, handed out from ``_lo`` up
    _lo: int
    _cached: FreeBlockQueue

    def free(self, blocks: Iterable[Block], source: list[Block] | None = None) -> None:
        """``release`` of a request's blocks as its ``free`` gives them (its tail first),
        except that those going empty are reused in the order given, the first first, as
        vLLM 0.33's ``BlockPool.free_blocks`` puts them at the front of its queue (so the
        next request takes the freed request's tail block first, as in vLLM).
        ``source``: as ``release``'s."""
        start = self._lo
        self.release(blocks, source)
        lo = self._lo
        if start - lo > 1:  # (the last given went in lowest, ``take``'s first: reversed)
            empty = self._empty
            empty[lo:start] = empty[lo:start][::-1]

    def free_groups(self, blocks: Iterable[Block],
                    tables: Sequence[Sequence[Block | None]]) -> None:
        """``free`` for a request of several layer groups (``tables``: its blocks, or those
        it releases, per group): the blocks going empty are reused group by group, the
        last group's first, each group's in the order given, as vLLM 0.33 frees a hybrid
        request (one ``free_blocks`` a group, in group order, each to the front)."""
        start = self._lo
        self.release(blocks)
        lo = self._lo
        if start - lo > 1:
            empty = self._empty
            last = len(tables) - 1
            rank = {id(b): last - g for g, t in enumerate(tables) for b in t if b is not None}
            going = sorted(empty[lo:start][::-1], key=lambda b: rank.get(id(b), 0))  # (stable,
            empty[lo:start] = going  # in the order released; ``take`` hands out from ``lo``)

    def release(self, blocks: Iterable[Block], source: list[Block] | None = None) -> None:
        """Drop one reference on each block, in the order given. A block reaching 0 joins
        the free queue: cached ones as most recently used, in the order given (so of
        blocks released together the first given is evicted first), the rest into the
        empty tier, the last given reused first (blocks a fetch or a plan took back go
        where they were taken from; a request's ``free``: ``free``). A spare copy of a
        cached content goes empty, and the block holding that content, if free, takes
        the spare's place in the LRU order. The blocks of a shared run (``Run``), given
        together, drop one count; at 0 they join as one segment (its two ends linked,
        when its own links still chain them). ``source``: the list that ``blocks``
        is ``reversed(source)`` of (a request's blocks, which ``free`` gives tail first):
        a run's blocks are then compared with one slice of it, not listed from the
        iterator (~20 ns a block: results/store25-r25.md)."""
        empty = self._empty
        _, tail = self._cached.ends()
        last = tail.prev  # each block joining is linked after ``last`` in place
        added = 0
        if not self.runs.shared:  # no block is counted through a run
            for b in blocks:
                b.refs -= 1
                if b.refs:
                    continue
                if b.key is None:  # (pushed on the empty tier, which grows down)
                    self._lo -= 1
                    empty[self._lo] = b
                elif not b.twin:
                    last.next = b
                    b.prev = last
                    last = b
                    added += 1
                else:
                    last = self._spare_freed(b, last)
            last.next = tail
            tail.prev = last
            self._cached.forget(-added)
            return
        it: Any = iter(blocks)  # (with ``source``: a list's reversed iterator)
        for b in it:
            r = b.counted
            if r is None:
                b.refs -= 1
                if b.refs:
                    continue
                if b.key is None:  # (pushed on the empty tier, which grows down)
                    self._lo -= 1
                    empty[self._lo] = b
                elif not b.twin:
                    last.next = b
                    b.prev = last
                    last = b
                    added += 1
                else:
                    last = self._spare_freed(b, last)
                continue
            n = len(r.blocks)
            if source is None:
                span = [b, *islice(it, n - 1)]
                fwd = span == r.blocks
                held = fwd or span[::-1] == r.blocks
            else:  # ``b`` is ``source[k]``: the run's blocks, given reversed, are a slice
                k = it.__length_hint__()  # (the blocks ``it`` has left: ``source[:k]``)
                assert source[k] is b, "release's blocks are not reversed(source)"
                span = source[k - n + 1 if k >= n else 0:k + 1]
                # (a list iterator's index, set as unpickling sets it: ``it`` goes on
                # before them, or, below 0, is at its end; no entry walked)
                it.__setstate__(k - n)
                fwd = n == 1  # (one block: given either way, forward as above)
                held = span == r.blocks
                span.reverse()  # (in place, no entry touched: the order given)
                if not held:  # (the source's order, not the run's: rare)
                    fwd = held = span == r.blocks
            if held:  # (a request's blocks, forward or reversed)
                r.n -= 1
                if r.n:
                    continue
                r.counts.free += 1  # each holds its content, found (not a spare)
                added += n
                if r.linked and r.fwd == fwd:  # one segment: its ends
                    last.next = b
                    b.prev = last
                    last = span[-1]
                    continue
                r.fwd = fwd  # (the order they join the cached tier in)
                r.linked = True
                for x in span:
                    last.next = x
                    x.prev = last
                    last = x
                continue
            for x in span:  # given otherwise (rare): each counted alone, released as such,
                if x.counted is not None:  # the cached tier closed at ``last`` meanwhile
                    x.counted.dissolve()
            last.next = tail
            tail.prev = last
            self._cached.forget(-added)
            added = 0
            self.release(span)
            last = tail.prev
        last.next = tail
        tail.prev = last
        self._cached.forget(-added)

    def _spare_freed(self, b: Block, last: Block) -> Block:
        """Spare ``b``'s last reference went: it goes empty, and the block holding its
        content, if free, takes its place after ``last``, the block ``release`` linked
        last (the cached tier's links after it are not written yet). Returns the new
        last."""
        primary = self.index.release_spare(b)
        self._lo -= 1  # (pushed on the empty tier)
        self._empty[self._lo] = b
        if primary is None:
            return last
        if primary.counted is not None:  # free, so in the cached tier: leaves its run's
            primary.counted.dissolve()  # segment
        if primary is last:  # the most recently used already
            return last
        prev, nxt = primary.prev, primary.next  # (``next`` is written: a block follows)
        prev.next = nxt
        nxt.prev = prev
        last.next = primary
        primary.prev = last
        return primary

    def emptied(self, blocks: Sequence[Block]) -> None:
        """Free cached ``blocks`` whose content the index just forgot (``Index.uncache``:
        descendants of KV found invalid) leave the cached tier for the empty one, where
        ``take`` reuses them first."""
        if blocks:
            self._cached.remove_all(list(blocks))
            lo = self._lo - len(blocks)  # (pushed in order: the last handed out first)
            self._empty[lo:self._lo] = list(blocks)[::-1]
            self._lo = lo
