"""vLLM 0.33's ``session_id`` on ``BlockStored``: the session of the request whose call
stored the blocks (``Request.session_id``, an agent's conversation; None for most).

vLLM's pool fills ``BlockStored.session_id`` from the request it caches blocks for. It
names who stored the blocks, not who owns them: it never enters a hash, and a later
request of another session hits the same blocks (vLLM's
``test_session_id_does_not_affect_prefix_cache_identity``). prefixkv's core records runs
of blocks without the request's session (its events are built later, from the index),
so the plug-in brackets what a call of a request with a session recorded: after
``allocate_slots`` or ``cache_blocks`` of such a request, the items the call added to
the core's event log are preceded by ``SessionMark(session_id)`` and followed by
``SessionMark(None)``; ``events.to_vllm_events`` gives the ``BlockStored`` between them
that session (and merges no run across sessions). Marks are events of no kind vLLM
knows: they are read there and never published. A restatement after the log
overflowed (``AllBlocksCleared`` and the findable blocks) names no session, as no call
stored those blocks then.

Installed only with ``enable_kv_cache_events``, on the manager object (``install``), so
a manager without events runs its class's calls, untouched; with events, a request
without a session pays one attribute read and one call frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["SessionMark", "install"]


class SessionMark:
    """In the core's event log: the ``BlockStored`` after it, up to the next mark, were
    stored by a call of a request of session ``session_id`` (None: of none)."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"SessionMark({self.session_id!r})"


def install(m: KVCacheManager) -> None:
    """Make ``m.allocate_slots`` and ``m.cache_blocks`` bracket what a request with a
    session records (the module docstring); the class's calls run inside."""
    log = getattr(m.core, "_events", None)
    if log is None or not getattr(log, "active", False):
        return
    m.allocate_slots = _bracketing(m.allocate_slots, log)  # type: ignore[method-assign]
    m.cache_blocks = _bracketing(m.cache_blocks, log)  # type: ignore[method-assign]


def _bracketing(call: Callable[..., Any], log: Any) -> Callable[..., Any]:
    def bracketed(request: Any, *args: Any, **kwargs: Any) -> Any:
        session = getattr(request, "session_id", None)
        if session is None:
            return call(request, *args, **kwargs)
        items, dropped = log._events, log.dropped
        start = len(items)
        out = call(request, *args, **kwargs)
        # (an overflow inside the call dropped the log: its restatement names no session)
        if len(items) > start and log.dropped == dropped:
            items.insert(start, SessionMark(session))
            items.append(SessionMark(None))
        return out

    bracketed.__name__ = bracketed.__qualname__ = getattr(call, "__name__", "call")
    bracketed.__doc__ = call.__doc__
    return bracketed
