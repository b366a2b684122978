"""Cache events, and the sinks the index writes them to.

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

Sinks: ``NullSink`` records nothing (events off); ``EventLog`` keeps events until the
engine drains them with ``take_events()``, bounded by ``max_events``. When a consumer
falls behind and the log overflows, the pending events are dropped and counted
(``dropped``), and the next drain starts with ``AllBlocksCleared`` followed by a
``BlockStored`` for every block findable at that moment: mirroring it resynchronises the
consumer exactly, whatever it missed.

Deferred events: the index does not build events (nor compute chain hashes) while it
admits; it hands the log one ``Deferred`` per run of blocks stored and per batch of
blocks removed, and the log builds them, in order, when they are taken (or when it
overflows or is cleared, so the blocks' hashes are always set in the order they were
recorded). ``take()`` returns the same events either way.
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


class Deferred:
    """Events not built yet: ``count`` of them, which ``events()`` builds (exactly once,
    in log order: building them may set state that later items read, such as the chain
    hashes of the blocks they name)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def events(self) -> list[Event]:
        raise NotImplementedError


class NullSink:
    """Records nothing: the sink of a manager without events."""

    __slots__ = ()
    active = False
    dropped = 0

    def append(self, event: Event) -> None:
        pass

    def extend(self, events: list[Event]) -> None:
        pass

    def defer(self, item: Deferred) -> None:
        pass

    def take(self) -> list[Event] | None:
        return []

    def clear(self) -> None:
        pass


class EventLog:
    """Events kept in order until taken, at most ``max_events`` of them (a ``Deferred``
    counts as the events it stands for).

    ``take()`` returns the events since the last take, or None when some were dropped
    since (the caller then restates the index, see the module docstring). ``dropped``
    counts every event dropped since creation.
    """

    __slots__ = ("max_events", "dropped", "_events", "_lost", "_deferred", "_extra")
    active = True

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.dropped = 0
        self._events: list[Event | Deferred] = []
        self._lost = False
        self._deferred = 0  # Deferred items in ``_events``
        self._extra = 0  # events they stand for beyond one each

    def __len__(self) -> int:
        return len(self._events) + self._extra

    def append(self, event: Event) -> None:
        self._events.append(event)
        if len(self._events) + self._extra > self.max_events:
            self._overflow()

    def extend(self, events: list[Event]) -> None:
        """``append`` each of ``events``, in order, in one call."""
        self._events += events
        if len(self._events) + self._extra > self.max_events:
            self._overflow()

    def defer(self, item: Deferred) -> None:
        """Append ``item.count`` events that ``item.events()`` builds when taken."""
        self._events.append(item)
        self._deferred += 1
        self._extra += item.count - 1
        if len(self._events) + self._extra > self.max_events:
            self._overflow()

    def clear(self) -> None:
        """Drop what is pending (an ``AllBlocksCleared`` that follows supersedes it)."""
        self._settle()
        self._events.clear()
        self._lost = False

    def _overflow(self) -> None:
        self.dropped += len(self)
        self._settle()
        self._events.clear()
        self._lost = True

    def _settle(self) -> None:
        """Build every deferred item (their state must be set even if their events go)."""
        if self._deferred:
            self._expand()

    def _expand(self) -> list[Event]:
        out: list[Event] = []
        for item in self._events:
            if isinstance(item, Deferred):
                out += item.events()
            else:
                out.append(item)
        self._deferred = self._extra = 0
        return out

    def take(self) -> list[Event] | None:
        if self._lost:
            self._lost = False
            self._settle()
            self._events.clear()
            return None
        out = self._expand() if self._deferred else self._events
        self._events = []
        return out  # type: ignore[return-value]


EventSink = NullSink | EventLog
"""Where a manager's parts record events: a log, or nothing when events are off."""
