"""The part of ``ContentRecorder`` that names contents outside the process: chain hashes
(only when consumed), ``BlockStored`` events and the contents a shared store will write.
It reads the recorder's state (set by ``ContentRecorder.__init__``).
"""

from __future__ import annotations

import struct
from functools import lru_cache

from ..core.block import Block
from ..core.request import Request
from ..events import stored_event
from .content_check import chunk_of as _chunk


class Announcer:
    """Hashes, events and store writes for ``ContentRecorder``."""

    _next_id: int  # (the recorder's: the next content id)

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

    def new_ids(self, n: int) -> range:
        """``n`` new content ids, in order (a run of blocks from the shared store)."""
        self._next_id += n
        return range(self._next_id - n, self._next_id)

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
