"""The event log: where a manager's parts record events until the engine takes them.

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

Handed-off events: ``take_pending()`` takes the log's items without building them and
returns a ``PendingEvents`` whose ``build()`` builds them later, on any thread (the
publisher's: ``EventPublisher.publish`` accepts it), so the scheduler's thread pays for no
chain hash. Builds still run in log order, each exactly once: a batch builds every
unbuilt batch handed off before it first, and so does the log before it builds anything
itself (a later ``take``, an overflow, a ``clear``).
"""

from __future__ import annotations

import threading

from .events import Event


class Deferred:
    """Events not built yet: ``count`` of them, which ``events()`` builds (exactly once,
    in log order: building them may set state that later items read, such as the chain
    hashes of the blocks they name). ``count`` is set by the subclass that makes one
    (no ``__init__`` here: ``StoredRun`` has none, see ``stored_run``)."""

    __slots__ = ("count",)
    count: int

    def events(self) -> list[Event]:
        raise NotImplementedError


class NullSink:
    """Records nothing: the sink of a manager without events."""

    __slots__ = ()
    active = False
    dropped = 0
    pending = False

    def append(self, event: Event) -> None:
        pass

    def extend(self, events: list[Event]) -> None:
        pass

    def defer(self, item: Deferred) -> None:
        pass

    def take(self) -> list[Event] | None:
        return []

    def take_pending(self) -> PendingEvents | None:
        return NOTHING

    def clear(self) -> None:
        pass


class EventLog:
    """Events kept in order until taken, at most ``max_events`` of them (a ``Deferred``
    counts as the events it stands for).

    ``take()`` returns the events since the last take, or None when some were dropped
    since (the caller then restates the index, see the module docstring); so does
    ``take_pending()``, as a ``PendingEvents`` built later. ``dropped`` counts every
    event dropped since creation.
    """

    __slots__ = ("max_events", "dropped", "_events", "_lost", "_deferred", "_extra",
                 "_handed", "_lock")
    active = True

    def __init__(self, max_events: int) -> None:
        self.max_events = max_events
        self.dropped = 0
        self._events: list[Event | Deferred] = []
        self._lost = False
        self._deferred = 0  # Deferred items in ``_events``
        self._extra = 0  # events they stand for beyond one each
        self._handed: PendingEvents | None = None  # the last batch handed off unbuilt
        self._lock = threading.Lock()  # one build at a time, the scheduler's or another's

    def __len__(self) -> int:
        return len(self._events) + self._extra

    @property
    def pending(self) -> bool:
        """Whether ``take`` would return something now (events, or None after a loss)."""
        return bool(self._events) or self._lost

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
        handed, self._handed = self._handed, None
        if handed is not None:  # (batches handed off first: they come before these items)
            handed.build()
        with self._lock:
            out = _expand(self._events)
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

    def take_pending(self) -> PendingEvents | None:
        """``take()``, the deferred items left for ``PendingEvents.build()``: None when
        events were dropped since the last take (the caller restates the index now);
        ``NOTHING`` when nothing was recorded (a decode step's: no object made)."""
        if not self._events and not self._lost:
            return NOTHING
        if self._lost or not self._deferred:
            out = self.take()
            return None if out is None else PendingEvents.built(out)
        # (``PendingEvents(...)`` inlined: no ``__init__`` frame, one a step; ``_Taken``)
        pending: PendingEvents = _Taken()
        pending._items, pending._prev, pending._events = self._events, self._handed, None
        pending._lock, pending.empty = self._lock, False  # (``_events`` holds one item)
        self._handed = pending
        self._events = []
        self._deferred = self._extra = 0
        return pending


def _expand(items: list[Event | Deferred]) -> list[Event]:
    """``items`` with each ``Deferred`` built into its events, in order."""
    out: list[Event] = []
    for item in items:
        if isinstance(item, Deferred):
            out += item.events()
        else:
            out.append(item)
    return out


class PendingEvents:
    """One step's events, taken unbuilt (``KVCacheManager.take_pending_events()``, made
    by the log's ``take_pending()``, never by a caller) and built by ``build()``: on any
    thread, any number of times (the first call builds, later ones return the same
    list). Building runs every unbuilt batch taken before this one first, under the
    log's lock, so each is built once and all of them in log order, whoever calls.
    Until built, the events' blocks keep the hashes of earlier builds; nothing of the
    manager but builds reads them (see ``prefixkv.index.announce``).

    ``empty``: whether the batch holds no event, known without building it (a batch
    taken unbuilt holds at least one item, though an item may build no event: it is
    empty once built then)."""

    __slots__ = ("_items", "_prev", "_events", "_lock", "empty")

    def __init__(self, items: list[Event | Deferred], prev: PendingEvents | None,
                 lock: threading.Lock) -> None:
        self._items = items
        self._prev = prev
        self._events: list[Event] | None = None
        self._lock = lock
        self.empty = not items

    @classmethod
    def built(cls, events: list[Event]) -> PendingEvents:
        """A batch built already (``events``)."""
        pending = cls([], None, threading.Lock())
        pending._events = events
        pending.empty = not events
        return pending

    @property
    def is_built(self) -> bool:
        """Whether ``build()`` has run (it returns at once from then on)."""
        return self._events is not None

    def build(self) -> list[Event]:
        """The events, oldest first, as ``take()`` would have returned them (``NOTHING``:
        a new empty list each call)."""
        done = self._events
        if done is not None:
            return done if done or self is not NOTHING else []
        with self._lock:
            todo: list[PendingEvents] = []
            p: PendingEvents | None = self
            while p is not None and p._events is None:
                todo.append(p)
                p = p._prev
            for p in reversed(todo):
                p._events = _expand(p._items)
                p.empty = not p._events
                p._items = []
                p._prev = None  # (an old batch is not kept alive by a newer one)
        assert self._events is not None
        return self._events


class _Taken(PendingEvents):
    """A ``PendingEvents`` as ``EventLog.take_pending`` makes it, a step's: called with
    no argument, it runs no ``__init__`` of Python (``object.__init__``, the C slot: the
    call is ``type_call``, ``object_new``, ``object_init``, paths the step runs anyway),
    where ``object.__new__(PendingEvents)`` parses an argument tuple in C paths of its
    own (``tp_new_wrapper``, ``PyTuple_GetSlice``: cold after the forward pass;
    benchmarks/results/events-r23.md). A ``PendingEvents`` in every other way."""

    __slots__ = ()
    __init__ = object.__init__

NOTHING = PendingEvents.built([])
"""The batch of every step that recorded no event (``take_pending()``: one object for
them all, which publishers pass over at once: ``EventPublisher.publish``)."""

EventSink = NullSink | EventLog
"""Where a manager's parts record events: a log, or nothing when events are off."""
