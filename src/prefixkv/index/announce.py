"""The part of ``ContentRecorder`` that names contents outside the process: chain hashes
(only when consumed), ``BlockStored``/``BlockRemoved`` events and the contents a shared
store will write. It reads the recorder's state (set by ``ContentRecorder.__init__``).

Events are built in one of two ways, fixed for the index's life:

- *deferred* (``lazy``: events on, no tier below, a built-in hash): a run of blocks
  stored becomes one ``StoredRun`` and a batch of evictions one ``RemovedRun`` in the
  event log; hashes and events are computed when the log is taken. Until then the
  blocks' ``hash`` and ``event`` hold whatever an earlier build set: only a build writes
  them, and builds run in log order, so a ``RemovedRun`` reads the hash of the content
  that was evicted even if its block has been refilled since, and a ``StoredRun`` reads
  its parent's hash after the parent's own run has set it. A block's ``event`` is then
  its ``StoredRun`` (shared by the run; ``StoredRun.event_of`` rebuilds the block's
  event for a snapshot), so the events handed out are not kept alive by the pool: ~0.7
  KB a block (the token ids as ints) that would otherwise stay in memory for every
  cached block and crowd the CPU caches that admission works in.
- *eager* (a tier or a shared store below needs every hash as the block is stored; a
  caller's hash callable must fail before anything changes): as each run is stored.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import lru_cache

from ..core.block import Block
from ..core.request import Request
from ..events import BlockStored, Deferred, Event, removed_event, stored_event
from ..extra_keys import ExtraKeys
from .content_check import chunk_of as _chunk
from .hasher import Hasher

# What ``_hashed`` prepares for a run: its token chunks, extra-key bytes and chain hashes
# (None until someone consumes them).
Prepared = tuple[list[bytes], list[bytes], list[bytes] | None]
# A block stored this step: the block, its content id, its chunk, its extras, its keys.
Fresh = tuple[Block, int, bytes, bytes, ExtraKeys | None]


class StoredRun(Deferred):
    """``BlockStored`` for each new content among ``blocks`` (full blocks ``first``,
    ``first + 1``, ... of one request, the first one's parent being ``parent``, None for
    block 0), built when taken. ``chunks``/``extras``: their token and extra-key bytes as
    recorded; ``twins``: ``(position in blocks, block found for that content)`` of the
    blocks that were spares when stored (not announced, but given the hash and event)."""

    __slots__ = ("hasher", "parent", "blocks", "chunks", "extras", "extra", "first", "bs",
                 "twins", "hashes", "parent_hash", "_pos")

    def __init__(self, hasher: Hasher, parent: Block | None, blocks: list[Block],
                 chunks: list[bytes], extras: list[bytes], extra: ExtraKeys | None,
                 first: int, bs: int, twins: list[tuple[int, Block]] | None) -> None:
        super().__init__(len(blocks) - (len(twins) if twins else 0))
        self.hasher, self.parent, self.blocks = hasher, parent, blocks
        self.chunks, self.extras, self.extra = chunks, extras, extra
        self.first, self.bs, self.twins = first, bs, twins
        self.hashes: list[bytes] = []
        self.parent_hash: bytes | None = None
        self._pos: dict[int, int] | None = None

    def events(self) -> list[Event]:
        self.parent_hash = parent = self.parent.hash if self.parent is not None else None
        self.hashes = hashes = self.hasher.chain(
            self.hasher.root if parent is None else parent, self.chunks, self.extras)
        self.parent = None  # (not kept alive by the blocks that keep this run)
        unpack, extra, bs, first = _token_ids(self.bs), self.extra, self.bs, self.first
        spares = dict(self.twins) if self.twins else None
        out: list[Event] = []
        for j, (b, h, chunk) in enumerate(zip(self.blocks, hashes, self.chunks, strict=True),
                                               first):
            b.hash = h
            held = spares.get(j - first) if spares else None
            if held is not None:  # (rare) its own event, as its primary's names it
                b.event = held.event if type(held.event) is not StoredRun else \
                    held.event.event_of(held)
            else:
                b.event = self
                out.append(stored_event(h, parent, unpack(chunk), b.block_id,
                                        None if extra is None else extra.for_range(
                                            j * bs, (j + 1) * bs)))
            parent = h
        return out

    def event_of(self, b: Block) -> BlockStored:
        """The ``BlockStored`` this run announced for its block ``b`` (after ``events``),
        with ``b``'s id."""
        if self._pos is None:
            self._pos = {id(x): i for i, x in enumerate(self.blocks)}
        i, bs = self._pos[id(b)], self.bs
        j = self.first + i
        return stored_event(self.hashes[i], self.hashes[i - 1] if i else self.parent_hash,
                            _token_ids(bs)(self.chunks[i]), b.block_id,
                            None if self.extra is None else self.extra.for_range(
                                j * bs, (j + 1) * bs))


class RemovedRun(Deferred):
    """``BlockRemoved`` for each of ``blocks``, evicted (or never computed), built when
    taken from the hash each then held."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[Block]) -> None:
        super().__init__(len(blocks))
        self.blocks = blocks

    def events(self) -> list[Event]:
        return [removed_event(b.hash, b.block_id) for b in self.blocks]  # type: ignore[arg-type]


class Announcer:
    """Hashes, events and store writes for ``ContentRecorder``."""

    hashing: bool
    lazy: bool
    fresh: list[tuple[object, ...]] | None
    _hasher: Hasher
    _bs: int
    _next_id: int

    def _hashed(self, parent: Block | None, chunks: list[bytes], extras: list[bytes]) -> tuple[object, ...]:
        """``(chunks, extras, chain hashes or None)``: hashes only when consumed now."""
        if not self.hashing or self.lazy:
            return chunks, extras, None
        root = parent.hash if parent is not None else self._hasher.root
        return chunks, extras, self._hasher.chain(root, chunks, extras)  # type: ignore[arg-type]

    def _note_fresh(self, req: Request, first: int, count: int) -> None:
        """Remember the contents first recorded now, for the shared store's writes:
        ``(block, content id, parent hash, token bytes, extra keys)``."""
        blocks = req.blocks
        parent = blocks[first - 1].hash if first else self._hasher.root
        for b in blocks[first:first + count]:
            if not b.twin:
                self.fresh.append((b, b.content_id, parent, _chunk(b), req.keys.extra))  # type: ignore[union-attr]
            parent = b.hash

    def new_id(self) -> int:
        """A new content id (for content that comes from outside: the shared store)."""
        self._next_id += 1
        return self._next_id - 1

    def new_ids(self, n: int) -> range:
        """``n`` new content ids, in order (a run of blocks from the shared store)."""
        self._next_id += n
        return range(self._next_id - n, self._next_id)

    def _announce(self, req: Request, first: int, hashes: list[bytes]) -> None:
        """Give the blocks just stored their chain hash; announce the new contents (eager)."""
        bs, blocks, keys = self._bs, req.blocks, req.keys
        unpack = _token_ids(bs)
        parent = blocks[first - 1].hash if first else None
        out: list[Event] = []
        for j, h in enumerate(hashes, first):
            b = blocks[j]
            if not b.twin:
                b.hash = h
                b.event = ev = stored_event(h, parent, unpack(_chunk(b)), b.block_id,
                                            None if keys.extra is None else keys.for_event(j, bs))
                out.append(ev)
            parent = h
        self._sink.extend(out)  # type: ignore[attr-defined]

    def _defer(self, req: Request, first: int, chunks: list[bytes], extras: list[bytes],
               twins: list[tuple[int, Block]] | None) -> None:
        """Announce blocks ``first..`` of ``req`` just stored, when the log is taken."""
        blocks = req.blocks
        self._sink.defer(StoredRun(  # type: ignore[attr-defined]
            self._hasher, blocks[first - 1] if first else None,
            blocks[first:first + len(chunks)], chunks, extras, req.keys.extra, first,
            self._bs, twins))


@lru_cache(maxsize=8)
def _token_ids(block_size: int) -> Callable[[bytes], tuple[int, ...]]:
    """The token ids of a block's little-endian uint32 bytes, as a tuple (in C)."""
    return struct.Struct(f"<{block_size}I").unpack
