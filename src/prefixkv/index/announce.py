"""The part of ``ContentRecorder`` that names contents outside the process: the blocks
to record, prepared with their chain hashes (``prepare``: hashes only when consumed),
``BlockStored``/``BlockRemoved`` events and the contents a shared store will write. It
reads the recorder's state (set by ``ContentChains.__init__``).

Events are run-level, as vLLM's: one ``BlockStored`` for each run of blocks a call
stores (split only where a block is a spare), one ``BlockRemoved`` for each batch of
evictions. They are built in one of two ways, fixed for the index's life:

- *deferred* (``lazy``: events on, no tier below, a built-in hash): a run of blocks
  stored becomes one ``StoredRun`` and a batch of evictions one ``RemovedRun`` in the
  event log; hashes and events are computed when the log is taken. Until then the
  blocks' ``hash`` and ``event`` hold whatever an earlier build set: only a build writes
  them, and builds run in log order, so a ``RemovedRun`` reads the hash of the content
  that was evicted even if its block has been refilled since, and a ``StoredRun`` reads
  its parent's hash after the parent's own run has set it.
- *eager* (a tier or a shared store below needs every hash as the block is stored; a
  caller's hash callable must fail before anything changes): as each run is stored.

Either way a block's ``event`` is its run's ``BlockStored``, shared by the run's blocks
(``BlockStored.block_of`` gives one block's part, for a snapshot or a copy in another
tier): per block the pool keeps a hash and a pointer, not an object; the run's token ids
are one bytes object (4 bytes a token), not ints.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from ..core.block import Block
from ..core.request import Request
from ..event_log import Deferred
from ..events import BlockRemoved, BlockStored, Event
from ..extra_keys import ExtraKeys
from ..hashing import block_chunks, token_bytes
from .content_check import chunk_of as _chunk
from .hasher import Hasher

if TYPE_CHECKING:
    from ..event_log import EventSink

# What ``_hashed`` prepares for a run: its token chunks, extra-key bytes and chain hashes
# (None until someone consumes them).
Prepared = tuple[Sequence[bytes], list[bytes], list[bytes] | None]
# A content the shared store will write: the block, its content id, its parent's hash,
# its token bytes, the request's extra keys.
Fresh = tuple[Block, int, bytes, bytes, ExtraKeys | None]
_U32 = struct.Struct("<I")


def announce(blocks: Sequence[Block], hashes: Sequence[bytes], parent: bytes | None,
             chunks: Sequence[bytes], first: int, bs: int, extra: ExtraKeys | None,
             spares: dict[int, Block] | None) -> list[Event]:
    """Give ``blocks`` (full blocks ``first, first + 1, ...`` of one request, the first
    one's parent hash being ``parent``) their chain hashes and their ``event``; returns
    the ``BlockStored`` events announcing them: one for the run, split where a block is
    a spare (``spares``: position in ``blocks`` -> the block found for its content, which
    announced it already; the spare takes that block's event)."""
    if not spares:
        ev = BlockStored(hashes, parent, b"".join(chunks), [b.block_id for b in blocks],
                         None if extra is None else
                         extra.for_range(first * bs, (first + len(blocks)) * bs), first)
        for b, h in zip(blocks, hashes):  # noqa: B905 (as long: ``hashes`` are the blocks')
            b.hash = h
            b.event = ev
        return [ev]
    out: list[Event] = []
    lo = 0
    for i in [*sorted(spares), len(blocks)]:  # (rare: a run with spares)
        if i > lo:
            out += announce(blocks[lo:i], hashes[lo:i], hashes[lo - 1] if lo else parent,
                            chunks[lo:i], first + lo, bs, extra, None)
        if i < len(blocks):
            b = blocks[i]
            b.hash, b.event = hashes[i], spares[i].event
        lo = i + 1
    return out


class StoredRun(Deferred):
    """The ``BlockStored`` events of ``blocks`` (full blocks ``first``, ``first + 1``, ...
    of one request, the first one's parent being ``parent``, None for block 0), built
    when taken (``announce``). ``chunks``/``extras``: their token and extra-key bytes as
    recorded; ``spares``: ``position in blocks -> block found for that content`` of the
    blocks that were spares when stored (not announced, but given the hash and event).
    No ``__init__``: ``stored_run`` makes one (``ContentRecorder._store_run`` sets the
    fields itself), as ``Run``."""

    __slots__ = ("hasher", "parent", "blocks", "chunks", "extras", "extra", "first", "bs",
                 "spares")
    hasher: Hasher
    parent: Block | None
    blocks: list[Block]
    chunks: Sequence[bytes]
    extras: list[bytes]
    extra: ExtraKeys | None
    first: int
    bs: int
    spares: dict[int, Block] | None

    def events(self) -> list[Event]:
        parent = self.parent.hash if self.parent is not None else None
        self.parent = None  # (not kept alive by the log)
        hashes = self.hasher.chain(self.hasher.root if parent is None else parent,
                                   self.chunks, self.extras)
        return announce(self.blocks, hashes, parent, self.chunks, self.first, self.bs,
                        self.extra, self.spares)


def stored_run(hasher: Hasher, parent: Block | None, blocks: list[Block],
               chunks: Sequence[bytes], extras: list[bytes], extra: ExtraKeys | None,
               first: int, bs: int, spares: dict[int, Block] | None) -> StoredRun:
    """The ``StoredRun`` of ``blocks`` (see there)."""
    r = StoredRun()
    r.count = 1 if spares is None else _num_runs(len(blocks), spares)
    r.hasher, r.parent, r.blocks = hasher, parent, blocks
    r.chunks, r.extras, r.extra = chunks, extras, extra
    r.first, r.bs, r.spares = first, bs, spares
    return r


def _num_runs(n: int, spares: dict[int, Block] | None) -> int:
    """How many runs ``announce`` splits ``n`` blocks into at ``spares``."""
    if not spares:
        return 1
    edges = [-1, *sorted(spares), n]
    return sum(1 for a, b in zip(edges, edges[1:]) if b > a + 1)  # noqa: B905


class RemovedRun(Deferred):
    """One ``BlockRemoved`` for ``blocks``, evicted (or never computed), built when taken
    from the hash each then held."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.count = 1  # (``Deferred.__init__`` inlined; this one is in ``DroppingIndex.drop``)
        self.blocks = blocks

    def events(self) -> list[Event]:
        return [removed(self.blocks)]


def removed(blocks: Sequence[Block]) -> BlockRemoved:
    """The ``BlockRemoved`` of ``blocks``' contents (each was announced: it has its hash)."""
    return BlockRemoved(cast("list[bytes]", [b.hash for b in blocks]),
                        [b.block_id for b in blocks])


class Announcer:
    """Hashes, events and store writes for ``ContentRecorder``."""

    hashing: bool
    lazy: bool
    fresh: list[Fresh] | None
    _hasher: Hasher
    _sink: EventSink
    _bs: int
    _next_id: int

    def _hashed(self, parent: Block | None, chunks: Sequence[bytes], extras: list[bytes]) -> Prepared:
        """``(chunks, extras, chain hashes or None)``: hashes only when consumed now."""
        if not self.hashing or self.lazy:
            return chunks, extras, None
        root = parent.hash if parent is not None else self._hasher.root
        assert root is not None, f"{parent!r} was stored without its chain hash"
        return chunks, extras, self._hasher.chain(root, chunks, extras)

    def prepare(self, req: Request, first: int, last: int, parent: Block | None) -> Prepared:
        known = req.prompt_chunks
        keys = req.keys  # (``of_blocks`` inlined for the common case: one call an admission)
        extras = [keys.base] * (last - first) if keys.mm is None else keys.of_blocks(first, last)
        if known is not None and last <= len(known):
            chunks = known[first:last]
            if not self.hashing or self.lazy:  # (``_hashed``'s first case, inlined)
                return chunks, extras, None
            known_hashes = req.prompt_hashes  # prepared: hashed where it was prepared
            if known_hashes is not None:
                assert parent is None or parent.hash == known_hashes[first - 1], \
                    "a prepared prompt's chain hashes are those of the blocks it hits"
                return chunks, extras, known_hashes[first:last]
        else:
            bs = self._bs
            chunks = block_chunks(token_bytes(req.tokens[first * bs:last * bs]), 4 * bs,
                                  last - first)
        return self._hashed(parent, chunks, extras)

    def prepare_next(self, req: Request, token: int) -> Prepared:
        """``prepare`` for the block that ``token``, appended next, fills."""
        bs, n = self._bs, req.num_scheduled
        j = n // bs
        chunks = [token_bytes(req.tokens[j * bs:n]) + _U32.pack(token)]
        return self._hashed(req.blocks[j - 1] if j else None, chunks, req.keys.of_blocks(j, j + 1))

    def _note_fresh(self, fresh: list[Fresh], req: Request, first: int, count: int) -> None:
        """Remember in ``fresh`` the contents first recorded now, for the shared store's
        writes: ``(block, content id, parent hash, token bytes, extra keys)``."""
        blocks = req.blocks
        parent = blocks[first - 1].hash if first else self._hasher.root
        for b in blocks[first:first + count]:
            assert parent is not None, f"{b!r}'s parent was stored without its chain hash"
            if not b.twin:
                fresh.append((b, b.content_id, parent, _chunk(b), req.keys.extra))
            parent = b.hash

    def new_id(self) -> int:
        """A new content id (for content that comes from outside: the shared store)."""
        self._next_id += 1
        return self._next_id - 1

    def new_ids(self, n: int) -> range:
        """``n`` new content ids, in order (a run of blocks from the shared store)."""
        self._next_id += n
        return range(self._next_id - n, self._next_id)

    def _announce(self, req: Request, first: int, chunks: Sequence[bytes],
                  hashes: list[bytes]) -> None:
        """Give the blocks just stored their chain hash; announce the new contents (eager).
        A spare has its hash and event already (``_add_twin``)."""
        run = req.blocks[first:first + len(hashes)]
        spares = {i: b for i, b in enumerate(run) if b.twin} or None
        parent = req.blocks[first - 1].hash if first else None
        self._sink.extend(announce(run, hashes, parent, chunks, first, self._bs,
                                   req.keys.extra, spares))
