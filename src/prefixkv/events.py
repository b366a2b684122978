"""Cache events, and the sinks the index writes them to.

A consumer that mirrors the events knows which blocks this manager can serve: a chain
hash is announced by one ``BlockStored`` when its content first becomes findable and
withdrawn by one ``BlockRemoved`` when the last block holding it is evicted (or was never
computed), so "every hash stored and not removed" predicts ``lookup`` exactly. (Under a
hash collision, which the built-in modes make negligible, two contents share a hash: a
consumer that counts stores and removals per hash stays exact.) Use
``hash_mode="sha256"`` for ids that are stable across processes.

Sinks: ``NullSink`` records nothing (events off); ``EventLog`` keeps events until the
engine drains them with ``take_events()``, bounded by ``max_events``. When a consumer
falls behind and the log overflows, the pending events are dropped and counted
(``dropped``), and the next drain starts with ``AllBlocksCleared`` followed by one
``BlockStored`` per block findable at that moment: mirroring it resynchronises the
consumer exactly, whatever it missed.

Deferred events: the index does not build events (nor compute chain hashes) while it
admits; it hands the log one ``Deferred`` per run of blocks stored and per batch of
blocks removed, and the log expands them, in order, when they are taken (or when it
overflows or is cleared, so the blocks' hashes are always set in the order they were
recorded). ``take()`` returns the same events either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .extra_keys import ExtraKeys

DEVICE = "GPU"
"""The medium of blocks in the device pool (vLLM's event field spells it "GPU")."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became findable under ``block_hash``. ``parent_block_hash`` is None
    for a request's first block. ``token_ids`` are the block's block_size tokens.
    ``block_id``: the block that holds it. ``extra``: the extra keys that entered this
    block's hash (LoRA, salt and only the multimodal inputs overlapping the block), None
    when there are none. ``medium``: where the block lives ("GPU": the device pool)."""

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_id: int
    extra: ExtraKeys | None
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """No block of ``medium`` holds the content stored under ``block_hash`` any more
    (evicted, or never computed); ``block_id`` is the last one that held it."""

    block_hash: bytes
    block_id: int
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block was dropped (``reset_prefix_cache()``), or the log overflowed and the
    ``BlockStored`` events that follow restate everything findable."""


def _setters(cls: type, fields: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(cls.__dict__[f].__set__ for f in fields)  # the slots' member descriptors


_STORED = _setters(BlockStored, ("block_hash", "parent_block_hash", "token_ids", "block_id",
                                 "extra", "medium"))
_REMOVED = _setters(BlockRemoved, ("block_hash", "block_id", "medium"))
_new = object.__new__


def stored_event(block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...],
                 block_id: int, extra: ExtraKeys | None, medium: str = DEVICE) -> BlockStored:
    """``BlockStored(...)``, the same (equal, hashing alike) object, built ~2x faster: a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; this
    writes the slots directly. For the index's hot paths (one event a stored block)."""
    ev = _new(BlockStored)
    a, b, c, d, e, f = _STORED
    a(ev, block_hash)
    b(ev, parent)
    c(ev, token_ids)
    d(ev, block_id)
    e(ev, extra)
    f(ev, medium)
    return ev


def removed_event(block_hash: bytes, block_id: int, medium: str = DEVICE) -> BlockRemoved:
    """``BlockRemoved(...)``, built as ``stored_event`` builds its event."""
    ev = _new(BlockRemoved)
    a, b, c = _REMOVED
    a(ev, block_hash)
    b(ev, block_id)
    c(ev, medium)
    return ev


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
