"""The block pool: every physical block, reference counts and the free queue.

The free queue has two tiers, reused in this order:

    empty tier  : free blocks holding no reusable content (a stack: last freed, first used)
                  ``_empty[_lo:]``, a list of ``num_blocks`` entries that grows down:
                  ``take`` hands out ``_empty[_lo]`` first and moves ``_lo`` up (a slice,
                  no ``del``, no reversal), a release writes below ``_lo`` and moves it
                  down; the entries below ``_lo`` are stale
    cached tier : free blocks whose content the index can find, LRU first (FreeBlockQueue)

so no cached block is evicted while an empty one is free. Eviction (``_evict``) happens
only when ``take`` needs a block and the empty tier is exhausted; it is the one step that
removes content from the index (``uncache`` does it for KV that was never computed).
"""

from __future__ import annotations

from .block import UNLINKED, Block
from .free_queue import FreeBlockQueue
from .keyless import Keyless, new_keyless
from .pool_check import check_pool
from .pool_release import PoolIndex, PoolRelease
from .run import RunCounts

__all__ = ["BlockPool", "PoolIndex"]


class BlockPool(PoolRelease):
    """``num_blocks`` blocks, created once, and the ``index`` that finds their content.
    ``runs``: the counts of the index's runs (``Run``), if it records any.
    Not thread-safe: one scheduler thread owns it."""

    def __init__(self, num_blocks: int, index: PoolIndex, runs: RunCounts | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.index = index
        self.runs = RunCounts() if runs is None else runs  # (none: each count stays 0)
        self._empty = self.blocks[:]  # (the empty tier: ``_empty[_lo:]``, block 0 used first)
        self._lo = 0
        self._cached = FreeBlockQueue()
        self._spare: list[Block] = []  # a store start's eviction list of no use (``_evict``)

    @property
    def num_free(self) -> int:
        return len(self._empty) - self._lo + self._cached.size

    def free_order(self) -> list[int]:
        """Free block ids in the order ``take`` would hand them out."""
        return [b.block_id for b in self._empty[self._lo:]] + [b.block_id for b in self._cached]

    def can_acquire(self, hits: list[Block], n: int) -> bool:
        """Whether ``acquire(hits, n)`` would succeed: the free queue can give ``n``
        blocks beside those of the hits that sit in it (unreferenced cache hits)."""
        free = self.num_free
        return n + len(hits) <= free or n + [b.ref_cnt for b in hits].count(0) <= free

    def acquire(self, hits: list[Block], n: int) -> list[Block]:
        """Take a reference on the cached ``hits`` and on ``n`` new blocks from ``take``.
        The caller checked ``can_acquire``."""
        unlinked = 0
        for b in hits:
            if b.counted is not None:  # (one block's count alone: see ``Run``)
                b.counted.dissolve()
            if not b.refs:  # a free cache hit leaves the cached tier (inlined unlink)
                prev, nxt = b.prev, b.next  # (b's own links go stale: never read again
                prev.next = nxt  # until it is linked anew)
                nxt.prev = prev
                unlinked += 1
            b.refs += 1
        self._cached.forget(unlinked)
        return hits + self.take(n) if n else hits[:]

    def claimed(self, unlinked: int) -> None:
        """Account for ``unlinked`` cache hits that ``Index.claim`` took out of the cached
        tier."""
        self._cached.size -= unlinked  # (forget, inlined)

    def unclaim(self, hits: list[Block], unlinked: int) -> None:
        """Undo ``Index.claim`` and ``claimed`` exactly: drop the references and relink
        the hits that left the cached tier where they were. In reverse order, each
        block's stale links name its neighbours as they were when it left."""
        self._cached.forget(-unlinked)
        last = None  # the shared run whose count this undid (its blocks are consecutive)
        for b in reversed(hits):
            r = b.counted
            if r is None:
                b.refs -= 1
                if b.refs:
                    continue
            elif r is last:
                if r.n:
                    continue
            else:
                if r.n > 1:
                    r.n -= 1
                    last = r
                    continue
                r.dissolve()  # (its blocks go back where each was, which need not be
                b.refs = 0  # consecutive: each counted alone; the others drop theirs below)
            b.prev.next = b
            b.next.prev = b

    def take(self, n: int, stale: bool = False) -> list[Block]:
        """Hand out ``n`` free blocks with refcount 1, empty ones first, then the least
        recently used cached ones (evicted). The caller checks ``n <= num_free``.
        ``stale``: the blocks of a pending run evicted whole keep its ``counted`` (the
        run evicted: its ``n`` is 1, each block's count as taken); the caller clears it
        on each of them before the block is anything but held (released, claimed,
        counted through a run, its count changed): a store fetch's start, whose fetcher
        writes the blocks of its run on its own thread (``store_fill``). The first such
        run's own list is the eviction's, the other blocks moved in around it (no entry of
        the run's is copied: each would touch a block, cold by now), and the one returned
        when fewer empty blocks are taken."""
        empty, lo = self._empty, self._lo
        k = len(empty) - lo
        if n < k:  # (not ``min``: its keyword parsing is ~45 lines of the interpreter's
            k = n  # machine code, cold after the forward pass; benchmarks/results/chat-r20.md)
        # (the empty tier grows down: its first k, in the order handed out; no ``del``
        # and no ``reverse``, C paths of their own, cold after the forward pass:
        # benchmarks/results/events-r23.md)
        taken = empty[lo:lo + k]
        self._lo = lo + k
        for b in taken:  # (an empty block is no shared run's: those hold content)
            b.refs = 1
        if n > k:
            evicted = self._evict(n - k, stale)
            if k < n - k:  # (the shorter list is the one copied: each entry a reference)
                evicted[:0] = taken
                return evicted
            taken.extend(evicted)  # (as ``add_request`` extends: not ``+=``, a C path of its own)
        return taken

    def take_split(self, u: int, n: int) -> tuple[list[Block], list[Block]]:
        """``take(u + n, True)`` cut after its first ``u`` blocks: the same blocks in the
        same order, as two lists (a store fetch's start: the host hits' blocks, then its
        run's and tail's). When the empty tier holds ``u`` blocks or more, the first take
        evicts nothing and the run's list is the eviction's as it came: no front insertion
        and deletion moving its ~n entries (two passes over a list of 16 KiB at 2048
        blocks, cold: store25a-r22b.md)."""
        lo = self._lo
        if len(self._empty) - lo >= u:  # (``take(u)``, inlined: the empty tier alone)
            front = self._empty[lo:lo + u]
            self._lo = lo + u
            for b in front:
                b.refs = 1
            return front, self.take(n, True)
        taken = self.take(u + n, True)
        front = taken[:u]
        del taken[:u]
        return front, taken

    def take_one(self) -> Block | None:
        """``take(1)[0]`` without the lists (a decoded token opening a block); None,
        with nothing changed, when no block is free."""
        b: Block | None
        lo = self._lo
        if lo < len(self._empty):
            b = self._empty[lo]
            self._lo = lo + 1
        else:
            b = self._cached.popleft()
            if b is None:
                return None
            if b.counted is not None:  # (its content goes)
                b.counted.broken()
            b.starts = None
            self.index.drop_one(b)
        b.refs = 1
        return b

    def _evict(self, n: int, stale: bool = False) -> list[Block]:
        """The eviction step: take the ``n`` least recently used cached free blocks
        (``n`` at most as many as there are), each with refcount 1 now, and drop their
        content from the index. (The queue's pop inlined, its links left stale, so that
        one loop over the blocks also sets their counts.) ``stale``: see ``take``."""
        assert 0 <= n <= self._cached.size, (n, self._cached.size)
        head = self._cached.head  # (``ends``, inlined)
        b = head.next
        if stale and len(self._spare) >= n:  # (its entries stale, each set before read)
            blocks, self._spare = self._spare, []
            del blocks[n:]
        else:
            blocks = [b] * n  # (each entry set below: a store, no call, per block)
        skip: list[tuple[int, int]] = []  # where pending runs' blocks are (lo, hi)
        keyless: Keyless | None = None  # their records, for a tier below (``spans``)
        hole: list[Block] | None = None  # a run kept ``stale``: its own list, at ``at``
        at = 0
        if self.runs.free:  # a free shared run's blocks may be among them
            spans = self.runs.spans
            i = 0
            while i < n:
                r = b.counted
                if r is not None:  # the first of a free shared run's blocks met: they are
                    # consecutive from here in the cached tier (its content goes below)
                    k = len(r.blocks)
                    pending = r.pending  # (no key in the index: ``Run.pending``)
                    kept = False
                    if k <= n - i:  # all of them: from its list, not its links, and no
                        seg = r.blocks  # pass to dissolve
                        if pending:  # (no key to drop; its record for the tier below)
                            skip.append((i, i + k))
                            if spans:
                                keyless = keyless or new_keyless()
                                keyless.add(i, r, 0 if r.fwd else k - 1, 1 if r.fwd else -1, k)
                        r.evicted()
                        if not r.fwd:  # (nothing reads an evicted run's list from now on:
                            seg.reverse()  # in the cached tier's order, in place, no copy)
                        kept = stale and pending  # (each keeps ``counted``: ``take``)
                        if kept:
                            r.n = 1
                    elif not r.fwd:  # its last blocks (children first): the run keeps the
                        k = n - i  # rest, still shared and free (their content stays)
                        if pending:
                            skip.append((i, n))
                            if spans:
                                keyless = keyless or new_keyless()
                                keyless.add(i, r, len(r.blocks) - 1, -1, k)
                        seg = r.truncate(len(r.blocks) - k)
                    else:  # its first blocks: the rest are counted alone from now on
                        r.broken()
                        seg = None
                    if seg is not None:
                        assert seg[0] is b, (seg[0], b)
                        b = seg[-1].next
                        if kept and hole is None:  # (not copied: each entry copied
                            hole, at = seg, i  # touches a block, cold by now)
                        else:
                            blocks[i:i + k] = seg
                        if not pending:
                            for x in seg:
                                x.counted = None
                                x.refs = 1
                                x.starts = None  # (a run it headed: see below)
                        elif not kept:  # one record: nothing of it for the index to drop
                            # (``skip``); each block's own count is 1 already (as
                            # recorded: nothing writes it while counted through a run);
                            # they head no run (a stale ``starts`` is checked by a claim)
                            for x in seg:
                                x.counted = None
                        i += k
                        continue
                blocks[i] = b
                b.refs = 1
                b.starts = None  # (a run it headed is of no use now: not kept alive by it)
                b = b.next
                i += 1
        else:  # no block in the cached tier is counted through a run
            for i in range(n):
                blocks[i] = b
                b.refs = 1
                b.starts = None
                b = b.next
        head.next, b.prev = b, head
        self._cached.size -= n  # (``forget``, inlined)
        if hole is not None:  # the kept run's list becomes the eviction's: the few
            after = blocks[at + len(hole):]  # blocks around it moved in (no entry of
            if at:  # the run's is copied; nothing reads an evicted run's list)
                hole[:0] = blocks[:at]
            hole += after
            self._spare = blocks  # (kept for the next such start: neither made nor freed,
            blocks = hole  # two passes over ~n entries, cold: store25-r23.md)
        self.index.drop(blocks, skip, keyless)
        return blocks

    def reset(self) -> bool:
        """Drop all cached content if no block is in use; returns whether it did. The
        free order stays as it was (``free_order``, the order ``take`` hands blocks out:
        empty ones, then the cached ones least recently used first), every block in the
        empty tier now: vLLM's ``BlockPool.reset_prefix_cache`` drops the hashes and
        keeps its free queue, so a block a request freed last (whose KV an offload may
        still read) is reused last, as before the reset."""
        if self.num_free != len(self.blocks):
            return False
        order = [*self._empty[self._lo:], *self._cached]  # (read before the links go)
        for b in self.blocks:
            if b.counted is not None:
                b.counted.dissolve()
            b.prev = b.next = UNLINKED
            b.clear_content()
        self._cached = FreeBlockQueue()
        self.index.clear()
        self._empty = order  # (all of it the empty tier, in that order)
        self._lo = 0
        return True

    def check(self, expected_refs: dict[int, int]) -> str | None:
        """The first inconsistency of counts and links against ``expected_refs`` (block
        id -> number of live requests holding it), None when sound (``pool_check.py``)."""
        return check_pool(self.blocks, self._empty[self._lo:], self._cached, self.num_free,
                          self.index, expected_refs)
