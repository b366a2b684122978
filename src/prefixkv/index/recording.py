"""The recording half of ``ContentIndex``: its state, and how the content of blocks that
became full is recorded (``prepare``, ``store``, ``store_filled``), with chain hashes and
events only when consumed, spares for equal content, and contents adopted from the tier
below. Finding (``match``, ``claim``), eviction and checks are in ``content.py``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import replace

from ..core.block import Block
from ..core.request import Request
from ..events import DEVICE, BlockStored
from ..hashing import block_chunks, token_bytes
from .content_check import chunk_of as _chunk
from .hasher import Hasher

_U32 = struct.Struct("<I")


class ContentRecorder:
    """``ContentIndex``'s state and its recording calls (see ``ContentIndex``)."""

    def __init__(self, hasher: Hasher, sink, block_size: int, *, lower=None) -> None:
        self._by_chunk: dict[bytes, Block] = {}
        self._by_key: dict[tuple, Block] = {}
        self._twins: dict[int, list[Block]] = {}  # content id -> held spares
        self._next_id = 1
        self._hasher = hasher
        self._sink = sink
        self._bs = block_size
        self._lower = lower  # the tier that keeps evicted content (HostTier), or None
        self.hashing = sink.active
        self.fresh: list[tuple] | None = None  # with a shared store: contents recorded
        self.hash_may_fail = self.hashing and hasher.checked  # a caller's hash callable
        self.step = 0  # the manager's step: content recorded now is computed this step

    def prepare(self, req: Request, first: int, last: int, parent: Block | None) -> tuple:
        known = req.prompt_chunks
        if known is not None and last <= len(known):
            chunks = known[first:last]
        else:
            bs = self._bs
            chunks = block_chunks(token_bytes(req.tokens[first * bs:last * bs]), 4 * bs,
                                  last - first)
        return self._hashed(parent, chunks, req.keys.of_blocks(first, last))

    def prepare_next(self, req: Request, token: int) -> tuple:
        """``prepare`` for the block that ``token``, appended next, fills."""
        bs, n = self._bs, req.num_scheduled
        j = n // bs
        chunks = [token_bytes(req.tokens[j * bs:n]) + _U32.pack(token)]
        return self._hashed(req.blocks[j - 1] if j else None, chunks, req.keys.of_blocks(j, j + 1))

    def store_filled(self, req: Request, j: int) -> None:
        """Record block ``j`` of ``req``, which the last token appended filled (decode).
        In the common case (a new content, no hashes wanted, no overflow keys, no tier
        below) one dict operation; else ``prepare`` and ``store``."""
        bs = self._bs
        chunk = req.tokens[j * bs:(j + 1) * bs].tobytes()
        mm = req.keys.mm
        extra = req.keys.base if mm is None or j >= len(mm) else mm[j]
        if self.hashing or self._by_key or self._lower is not None:
            self.store(req, j, self._hashed(req.blocks[j - 1] if j else None, [chunk], [extra]))
            return
        b = req.blocks[j]
        held = self._by_chunk.setdefault(chunk, b)
        if held is not b:  # equal tokens are held already: the general path decides
            self.store(req, j, ([chunk], [extra], None))
            return
        parent = req.blocks[j - 1] if j else None
        if parent is not None:
            parent.child = b
            b.parent_cid = parent.content_id
        else:
            b.parent_cid = 0
        b.extra, b.step, b.key = extra, self.step, chunk
        b.content_id = self._next_id
        self._next_id += 1

    def _hashed(self, parent: Block | None, chunks: list[bytes], extras: list[bytes]) -> tuple:
        """``(chunks, extras, chain hashes or None)``: hashes only when consumed."""
        if not self.hashing:
            return chunks, extras, None
        root = parent.hash if parent is not None else self._hasher.root
        return chunks, extras, self._hasher.chain(root, chunks, extras)  # type: ignore[arg-type]

    def store(self, req: Request, first: int, prepared: tuple) -> None:
        chunks, extras, hashes = prepared
        setdefault = self._by_chunk.setdefault
        blocks = req.blocks
        cid = blocks[first - 1].content_id if first else 0
        nid = self._next_id
        by_key, lower = self._by_key, self._lower
        step = self.step
        parent = blocks[first - 1] if first else None
        for b, chunk, extra in zip(blocks[first:first + len(chunks)], chunks, extras):
            b.parent_cid = cid
            b.extra = extra
            b.step = step
            held = setdefault(chunk, b)
            if held is b:  # keyed by its tokens (the common case), unless one content, one
                held = by_key.get((cid, chunk, extra)) if by_key else None  # entry: it may be
                if held is not None:  # held under its triple (its tokens' key freed since)
                    del self._by_chunk[chunk]
                else:
                    b.key = chunk
            elif held.parent_cid != cid or held.extra != extra:  # the tokens' key is taken
                b.key = key = (cid, chunk, extra)
                held = by_key.setdefault(key, b)
                if held is b:
                    held = None
            if held is not None:  # equal content is held: b is its spare
                cid = self._add_twin(b, held)
                parent = held
                continue
            if parent is not None:  # the guess ``claim`` tries first after the parent
                parent.child = b
            parent = b
            # a new content; one content, one id: recomputed while a host slot keeps it,
            # it takes the slot's id, so the slot's children stay findable below it
            slot = lower.find(cid, chunk, extra) if lower is not None else None
            if slot is None:
                b.content_id = cid = nid
                nid += 1
            else:
                b.content_id = cid = slot.content_id
        self._next_id = nid
        if hashes is not None:
            self._announce(req, first, hashes)
            if self.fresh is not None:
                self._note_fresh(req, first, len(hashes))

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

    def adopt(self, blocks: Sequence[Block], slots: Sequence[Block]) -> None:
        """Record in each fresh device block of ``blocks`` the content of the host slot
        beside it in ``slots`` (whose copies the tier states): the same content ids, so
        the chain goes on below them. The device holds none of these contents."""
        setdefault, by_key, step = self._by_chunk.setdefault, self._by_key, self.step
        sink = self._sink if self._sink.active else None
        for b, s in zip(blocks, slots):
            key = s.key
            chunk = key if type(key) is bytes else key[1]  # type: ignore[index]
            b.parent_cid, b.extra = s.parent_cid, s.extra
            if setdefault(chunk, b) is b:
                b.key = chunk
            else:  # the token bytes are another content's key: keyed by the triple
                b.key = key = (s.parent_cid, chunk, s.extra)
                by_key[key] = b
            b.content_id, b.hash, b.step = s.content_id, s.hash, step
            ev = s.event if sink is not None else None
            if ev is None:
                b.event = None
            else:
                b.event = ev = replace(ev, block_id=b.block_id, medium=DEVICE)  # type: ignore[arg-type]
                sink.append(ev)  # type: ignore[union-attr]

    def _add_twin(self, b: Block, held: Block) -> int:
        """Equal content is already held by ``held``: ``b`` becomes its spare."""
        b.key = held.key
        b.content_id = held.content_id
        b.twin = True
        b.hash, b.event = held.hash, held.event
        self._twins.setdefault(held.content_id, []).append(b)
        return held.content_id

    def _announce(self, req: Request, first: int, hashes: list[bytes]) -> None:
        """Give the blocks just stored their chain hash; announce the new contents."""
        bs, blocks, tokens = self._bs, req.blocks, req.tokens
        parent = blocks[first - 1].hash if first else None
        for j in range(first, first + len(hashes)):
            b = blocks[j]
            h = hashes[j - first]
            if not b.twin:
                b.hash = h
                b.event = ev = BlockStored(h, parent, tuple(tokens[j * bs:(j + 1) * bs]),
                                           b.block_id, req.keys.for_event(j, bs))
                self._sink.append(ev)
            parent = h
