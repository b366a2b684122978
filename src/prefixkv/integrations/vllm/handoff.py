"""KV events built on vLLM's publisher thread instead of the scheduler's.

vLLM 0.33's scheduler takes its manager's events once a step (``take_events()``), wraps
them in a ``KVEventBatch`` and hands that to its ``ZmqEventPublisher``, whose own thread
encodes and sends it. prefixkv builds a step's events (the chain hashes of the blocks
stored, the event objects) when they are taken, a few hundred ns a block; done on the
scheduler's thread that is most of what events cost (docs/events.md, "What events cost
the scheduler"). Here the build moves to the publisher's thread:

- ``PendingVllmEvents``: what the manager's ``take_events()`` returns once
  ``hand_off(publisher)`` succeeded: a ``list`` that stays empty until ``build()`` fills
  it. The scheduler's thread only asks whether it holds anything (``if events:``) and
  may ``extend`` it with its KV connector's events, which follow the manager's;
- ``hand_off(publisher)``: gives vLLM's ``ZmqEventPublisher`` a queue whose ``get``, on
  the publisher's thread, builds a batch's ``PendingVllmEvents`` into a plain list of
  vLLM's events before vLLM's thread encodes it; so the bytes sent are those of the
  list ``take_events()`` builds otherwise (tests/engines/test_vllm_handoff.py compares
  them).

This reaches into one private attribute of vLLM's publisher (``_event_queue``, which its
thread reads anew on every turn of its loop), which is why the version is pinned. Any
other publisher (vLLM's ``NullEventPublisher``, a subclass, one of the user's) is left
alone, and the manager then builds as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from queue import Queue
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, ZmqEventPublisher

from prefixkv.event_log import PendingEvents

from .events import to_vllm_events

__all__ = ["PendingVllmEvents", "hand_off"]

log = logging.getLogger(__name__)


class PendingVllmEvents(list[Any]):
    """A step's events as vLLM's ``KVCacheEvent`` objects, not built yet: empty (for
    ``len``, iteration and encoders) until ``build()``. ``bool()`` says whether it holds
    events without building them; ``extend`` adds events to come after the manager's
    (vLLM's scheduler adds its connector's there). Not thread-safe: the scheduler's
    thread stops touching it once it published it, and one thread builds it."""

    def __init__(self, pending: PendingEvents, block_size: int,
                 spec_of_group: Sequence[tuple[str, int | None]]) -> None:
        super().__init__()
        self._pending: PendingEvents | None = pending
        self._block_size, self._spec_of_group = block_size, spec_of_group
        self._tail: list[Any] = []

    def __bool__(self) -> bool:
        if self._pending is None:
            return len(self) > 0
        return not self._pending.empty or bool(self._tail)

    def extend(self, events: Iterable[Any]) -> None:
        if self._pending is None:
            super().extend(events)
        else:
            self._tail.extend(events)

    def build(self) -> list[KVCacheEvent]:
        """The events, as the manager's ``take_events()`` would have returned them, then
        those ``extend`` added: a new plain list (this one holds them too, after)."""
        if self._pending is not None:
            built = to_vllm_events(self._pending.build(), self._block_size, self._spec_of_group)
            super().extend(built + self._tail)
            self._pending, self._tail = None, []
        return list(self)


class _BuildingQueue(Queue[Any]):
    """vLLM's publisher queue, whose ``get`` (on the publisher's thread) builds a batch's
    pending events. A build that raises is logged and the batch goes out empty, as
    vLLM's thread drops a batch it fails to send."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        events = getattr(item, "events", None)
        if isinstance(events, PendingVllmEvents):
            try:
                item.events = events.build()
            except Exception:
                log.exception("prefixkv: building a step's KV events failed; batch sent empty")
                item.events = []
        return item


def hand_off(publisher: object) -> bool:
    """Make ``publisher`` build ``PendingVllmEvents`` on its own thread, if it is vLLM's
    ``ZmqEventPublisher`` itself (not a subclass); returns whether it is. Call it before
    anything is published (what is queued already stays in the old queue, unsent)."""
    if type(publisher) is not ZmqEventPublisher:
        return False
    zmq_publisher: Any = publisher  # (vLLM's types are not followed: pyproject.toml)
    old: Queue[Any] = zmq_publisher._event_queue  # noqa: SLF001 (vLLM 0.33's, module doc)
    zmq_publisher._event_queue = _BuildingQueue(maxsize=old.maxsize)
    return True
