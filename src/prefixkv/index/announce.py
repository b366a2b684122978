"""The part of ``ContentRecorder`` that names contents outside the process: chain hashes
(only when consumed), ``BlockStored`` events, the contents a shared store will write, and
contents adopted from the tier below with their ids and hashes. It reads the recorder's
state (set by ``ContentRecorder.__init__``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from ..core.block import Block
from ..core.request import Request
from ..events import DEVICE, stored_event
from .content_check import chunk_of as _chunk


class Announcer:
    """Hashes, events, store writes and adopted contents for ``ContentRecorder``."""

    def _hashed(self, parent: Block | None, chunks: list[bytes], extras: list[bytes]) -> tuple:
        """``(chunks, extras, chain hashes or None)``: hashes only when consumed."""
        if not self.hashing:
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

    def _announce(self, req: Request, first: int, hashes: list[bytes]) -> None:
        """Give the blocks just stored their chain hash; announce the new contents."""
        bs, blocks, keys = self._bs, req.blocks, req.keys
        unpack = _token_ids(bs)
        parent = blocks[first - 1].hash if first else None
        out = []
        for j, h in enumerate(hashes, first):
            b = blocks[j]
            if not b.twin:
                b.hash = h
                b.event = ev = stored_event(h, parent, unpack(_chunk(b)), b.block_id,
                                            None if keys.extra is None else keys.for_event(j, bs))
                out.append(ev)
            parent = h
        self._sink.extend(out)


@lru_cache(maxsize=8)
def _token_ids(block_size: int):
    """The token ids of a block's little-endian uint32 bytes, as a tuple (in C)."""
    return struct.Struct(f"<{block_size}I").unpack
