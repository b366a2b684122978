"""Cache events: what a manager announces about the contents it can serve.

A consumer that mirrors the events knows which blocks this manager can serve: a chain
hash is announced by a ``BlockStored`` when its content first becomes findable and
withdrawn by a ``BlockRemoved`` when the last block holding it is evicted (or was never
computed), so "every hash stored and not removed" predicts ``lookup`` exactly. (Under a
hash collision, which the built-in modes make negligible, two contents share a hash: a
consumer that counts stores and removals per hash stays exact.) Use
``hash_mode="sha256"`` for ids that are stable across processes.

Events are run-level, as vLLM's: one ``BlockStored`` announces a run of consecutive full
blocks of one request (their hashes as a tuple, the run's token ids as one buffer), one
``BlockRemoved`` a batch of evictions.

The sinks that record them, and deferred building: ``prefixkv.event_log``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .extra_keys import ExtraKeys

DEVICE = "GPU"
"""The medium of blocks in the device pool (vLLM's event field spells it "GPU")."""

_SWAP = sys.byteorder != "little"
_U32 = "I" if array("I").itemsize == 4 else "L"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of full blocks of one request became findable: block i of the run under
    ``block_hashes[i]``, its parent being ``block_hashes[i - 1]``, or for the first one
    ``parent_block_hash`` (None when the run starts at the request's first block).
    ``token_bytes``: the run's ``len(block_hashes) * block_size`` token ids, uint32
    little-endian (the encoding the chain hashes; ``token_ids`` decodes them).
    ``block_ids[i]``: the block that holds block i. ``first_block``: the position of the
    run's first block in its request (its first token is ``first_block * block_size``).
    ``extra``: the extra keys that entered the run's hashes (LoRA, salt and the
    multimodal inputs overlapping the run; ``block_extra(i)``: those of block i), None
    when there are none. ``medium``: where the blocks live ("GPU": the device pool).
    ``block_hashes`` and ``block_ids`` are lists, as vLLM's, which nothing changes once
    the event is built: read them, never write them (the event is frozen, its lists are
    not copied to make it)."""

    block_hashes: Sequence[bytes]
    parent_block_hash: bytes | None
    token_bytes: bytes
    block_ids: Sequence[int]
    extra: ExtraKeys | None
    first_block: int
    medium: str = DEVICE

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return len(self.token_bytes) // (4 * len(self.block_hashes))

    @property
    def token_ids(self) -> list[int]:
        """The run's token ids (decoded from ``token_bytes`` on each read)."""
        arr = array(_U32)
        arr.frombytes(self.token_bytes)
        if _SWAP:  # pragma: no cover - big-endian hosts only
            arr.byteswap()
        return arr.tolist()

    def block_extra(self, i: int) -> ExtraKeys | None:
        """The extra keys that entered block i's hash (only its own multimodal inputs)."""
        if self.extra is None:
            return None
        bs = self.block_size
        start = (self.first_block + i) * bs
        return self.extra.for_range(start, start + bs)

    def block(self, i: int, block_id: int, medium: str) -> BlockStored:
        """Block i of the run alone, held by ``block_id`` in ``medium`` (a copy of it
        elsewhere: a host slot, a device block loaded from one); other fields (a
        subclass's group) as here."""
        if len(self.block_ids) == 1 and self.block_ids[0] == block_id and self.medium == medium:
            return self
        width = 4 * self.block_size
        return replace(self, block_hashes=(self.block_hashes[i],),
                       parent_block_hash=self.block_hashes[i - 1] if i else
                       self.parent_block_hash,
                       token_bytes=self.token_bytes[i * width:(i + 1) * width],
                       block_ids=(block_id,), extra=self.block_extra(i),
                       first_block=self.first_block + i, medium=medium)

    def block_of(self, block_hash: bytes, block_id: int, medium: str) -> BlockStored:
        """``block(i, ...)`` of the block the run announced under ``block_hash``."""
        return self.block(self.block_hashes.index(block_hash), block_id, medium)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """No block of ``medium`` holds the contents stored under ``block_hashes`` any more
    (evicted, or never computed); ``block_ids[i]`` is the last block that held the i-th."""

    block_hashes: Sequence[bytes]
    block_ids: Sequence[int]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block was dropped (``reset_prefix_cache()``), or the log overflowed and the
    ``BlockStored`` events that follow restate everything findable."""


Event = BlockStored | BlockRemoved | AllBlocksCleared
"""Any of the three events ``take_events()`` returns."""
