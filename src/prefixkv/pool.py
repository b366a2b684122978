"""The block pool: every physical block, the free queue, and the identity index.

The free queue has two tiers, reused in this order:

    empty tier  : free blocks holding no reusable content (a stack: last freed, first used)
    cached tier : free blocks still in the index, LRU first (FreeBlockQueue)

so no cached block is evicted while an empty one is free. Eviction (``_evict``) happens only
when ``take`` needs a block and the empty tier is exhausted; ``_forget`` is the one place
an identity leaves the index (eviction, or blocks whose KV was never computed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .block import Block
from .errors import InvariantError
from .events import AllBlocksCleared, BlockRemoved, Event
from .free_queue import FreeBlockQueue


class BlockPool:
    """``num_blocks`` blocks, created once. Not thread-safe: one scheduler thread owns it."""

    def __init__(self, num_blocks: int, events: list[Event] | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty = self.blocks[::-1]  # pop from the end: block 0 is used first
        self._cached = FreeBlockQueue()
        self._index: dict[bytes, Block] = {}
        self._next_cid = 1
        self._events = events

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks in the index (in use or free)."""
        return len(self._index)

    def free_order(self) -> list[int]:
        """Free block ids in the order ``take`` would hand them out."""
        return [b.block_id for b in reversed(self._empty)] + [b.block_id for b in self._cached]

    def lookup(
        self, hashes: Sequence[bytes], chunks: Sequence[bytes], extras: Sequence[bytes], limit: int
    ) -> list[Block]:
        """The longest run of cached blocks matching blocks ``0..limit-1``, stopping at the
        first miss. A candidate found by hash counts only if its parent content, tokens and
        extra keys equal the request's: a hash collision costs a miss, never wrong KV."""
        index = self._index
        hits: list[Block] = []
        parent_cid = 0
        for i in range(limit):
            b = index.get(hashes[i])
            if b is None or b.parent_cid != parent_cid or b.tokens != chunks[i] or b.extra != extras[i]:
                break
            hits.append(b)
            parent_cid = b.cid
        return hits

    def acquire(self, hits: list[Block], n: int) -> list[Block] | None:
        """Take a reference on the cached ``hits`` and on ``n`` new blocks from ``take``,
        all or nothing: None, with nothing changed, when the free queue cannot give ``n``
        blocks beside those of the hits that sit in it (unreferenced cache hits)."""
        free_hits = [b for b in hits if b.ref_cnt == 0]
        if n > self.num_free - len(free_hits):
            return None
        self._cached.remove_all(free_hits)
        for b in hits:
            b.ref_cnt += 1
        return hits + self.take(n) if n else hits[:]

    def take(self, n: int) -> list[Block]:
        """Hand out ``n`` free blocks with refcount 1, empty ones first, then the least
        recently used cached ones (evicted). The caller checks ``n <= num_free``."""
        empty = self._empty
        k = min(n, len(empty))
        taken = empty[len(empty) - k:]
        del empty[len(empty) - k:]
        taken.reverse()
        if n > k:
            taken += self._evict(n - k)
        for b in taken:
            b.ref_cnt = 1
        return taken

    def _evict(self, n: int) -> list[Block]:
        """The eviction step: take the ``n`` least recently used cached free blocks, drop
        their identity (``_forget``) and their content."""
        blocks = self._cached.popleft_n(n)
        self._forget(blocks)
        for b in blocks:
            b.cid = 0
        return blocks

    def uncache(self, blocks: list[Block]) -> None:
        """Make held ``blocks`` unfindable (their KV was never computed: the request was
        dropped before its step ran). They keep their references."""
        self._forget([b for b in blocks if b.hash is not None])

    def _forget(self, blocks: list[Block]) -> None:
        """The only place an identity leaves the index."""
        index, events = self._index, self._events
        for b in blocks:
            del index[b.hash]  # type: ignore[arg-type]  # callers pass indexed blocks
            if events is not None:
                events.append(BlockRemoved(b.hash, b.block_id))  # type: ignore[arg-type]
            b.hash = None

    def fill(self, blocks: list[Block], first: int, hashes: Sequence[bytes],
             chunks: Sequence[bytes], extras: Sequence[bytes]) -> Sequence[int]:
        """Record the content of ``blocks[first:first + len(hashes)]``, which just became
        full (their parents are the blocks before them), and index each under its hash
        unless the hash is taken. Returns the positions that were indexed (findable).

        A taken hash with equal content means a duplicate (two blocks computed the same
        KV): the block shares the indexed one's content id, so its children stay
        findable. A taken hash with other content is a collision: not indexed."""
        index = self._index
        cid = self._next_cid
        parent_cid = blocks[first - 1].cid if first else 0
        run = blocks[first:first + len(hashes)]
        if index.keys().isdisjoint(hashes):  # the common case: every hash is new ...
            size = len(index)
            index.update(zip(hashes, run))
            if len(index) == size + len(run):  # ... and no two of them are equal
                for b, h, chunk, extra in zip(run, hashes, chunks, extras):
                    b.hash = h
                    b.parent_cid = parent_cid
                    b.cid = parent_cid = cid
                    cid += 1
                    b.tokens = chunk
                    b.extra = extra
                self._next_cid = cid
                return range(first, first + len(run))
            for h in hashes:  # a collision inside the run: undo, take the careful path
                index.pop(h, None)
        stored = []
        pos = first
        for b, h, chunk, extra in zip(run, hashes, chunks, extras):
            existing = index.get(h)
            if existing is None:
                b.cid = cid
                cid += 1
                b.hash = h
                index[h] = b
                stored.append(pos)
            elif existing.parent_cid == parent_cid and existing.tokens == chunk and existing.extra == extra:
                b.cid = existing.cid
            else:
                b.cid = cid
                cid += 1
            b.parent_cid = parent_cid
            b.tokens = chunk
            b.extra = extra
            parent_cid = b.cid
            pos += 1
        self._next_cid = cid
        return stored

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given. A block reaching 0 joins
        the free queue: cached ones as most recently used, in the order given (so of
        blocks released together the first given is evicted first), the rest into the
        empty tier."""
        to_cache = []
        empty = self._empty
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hash is not None:
                    to_cache.append(b)
                else:
                    b.clear_content()
                    empty.append(b)
        self._cached.extend(to_cache)

    def reset(self) -> bool:
        """Drop all cached content if no block is in use; returns whether it did."""
        if self.num_free != len(self.blocks):
            return False
        for b in self.blocks:
            b.prev = b.next = None
            b.clear_content()
        self._cached = FreeBlockQueue()
        self._index.clear()
        self._empty = self.blocks[::-1]
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def check_invariants(self, expected_refs: dict[int, int]) -> None:
        """Verify counts and links against ``expected_refs`` (block id -> number of live
        requests holding it). Raises InvariantError with the numbers."""
        seen: set[int] = set()
        for b in self._empty:
            _require(b.block_id not in seen, f"block {b.block_id} twice in the free queue")
            _require(b.ref_cnt == 0 and b.hash is None and b.cid == 0, f"bad empty-tier block {b!r}")
            _require(b.prev is None and b.next is None, f"empty-tier block {b.block_id} is linked")
            seen.add(b.block_id)
        count = 0
        prev = self._cached._head
        for b in self._cached:
            _require(b.prev is prev, f"broken prev link at block {b.block_id}")
            _require(b.block_id not in seen, f"block {b.block_id} twice in the free queue")
            _require(b.ref_cnt == 0 and b.hash is not None, f"bad cached-tier block {b!r}")
            seen.add(b.block_id)
            prev = b
            count += 1
        _require(count == len(self._cached), f"cached tier length {len(self._cached)} != {count} linked")
        for b in self.blocks:
            want = expected_refs.get(b.block_id, 0)
            _require(b.ref_cnt == want, f"block {b.block_id} ref_cnt {b.ref_cnt}, held by {want} requests")
            _require((b.ref_cnt == 0) == (b.block_id in seen), f"block {b.block_id}: ref_cnt "
                     f"{b.ref_cnt} but {'in' if b.block_id in seen else 'not in'} the free queue")
            if b.hash is not None:
                _require(self._index.get(b.hash) is b, f"block {b.block_id} has a hash not indexed to it")
        _require(all(b.hash == h for h, b in self._index.items()), "index entry under a foreign hash")
        _require(len(seen) == self.num_free, f"free queue holds {len(seen)} != num_free {self.num_free}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)
