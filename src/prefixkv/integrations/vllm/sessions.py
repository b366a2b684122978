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

Installed on the manager object only, with ``enable_kv_cache_events``, and only once a
request with a session shows (``watch``: its lookup, ``get_computed_blocks``, or its
admission, ``allocate_slots`` of a request holding no blocks, calls ``seen``): until
then every call runs the class's, untouched (no decode step pays); from then on, a
request without a session pays one attribute read and one call frame. The call in which
a session first shows is bracketed from its admission on (``seen`` returns the bracket
to close): what a layout stores outside the admission in that one call (lookahead
hashing's keys taken before it, for a request never looked up) is not the session's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import KVCacheManager

__all__ = ["Bracket", "SessionMark", "admitting", "seen", "watch"]


class SessionMark:
    """In the core's event log: the ``BlockStored`` after it, up to the next mark, were
    stored by a call of a request of session ``session_id`` (None: of none)."""

    __slots__ = ("session_id",)

    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"SessionMark({self.session_id!r})"


def watch(m: KVCacheManager) -> None:
    """Set ``m._watch_sessions``: whether ``seen`` should be called (events on, and the
    calls not bracketed yet)."""
    log = getattr(m.core, "_events", None)
    m._watch_sessions = bool(m.enable_kv_cache_events and getattr(log, "active", False))


def seen(m: KVCacheManager, session: str) -> Bracket:
    """A request of ``session`` shows: bracket ``m.allocate_slots`` and ``m.cache_blocks``
    from now on (the module docstring); the bracket of the call under way, which its
    caller closes (``Bracket.close``) after the admission it runs."""
    m._watch_sessions = False
    log = m.core._events
    m.allocate_slots = _bracketing(m.allocate_slots, log)  # type: ignore[method-assign]
    m.cache_blocks = _bracketing(m.cache_blocks, log)  # type: ignore[method-assign]
    return Bracket(log, session)


def admitting(admit: Callable[..., Any], m: KVCacheManager, request: Any, *args: Any) -> Any:
    """``admit(m, request, *args)`` (slots.py) while ``m._watch_sessions``: bracketed, the
    calls bracketed from now on (``seen``), when the request has a session."""
    session = getattr(request, "session_id", None)
    if session is None:
        return admit(m, request, *args)
    bracket = seen(m, session)
    try:
        return admit(m, request, *args)
    finally:
        bracket.close()


class Bracket:
    """What the log records from now until ``close()`` was stored for ``session``."""

    __slots__ = ("_log", "_session", "_items", "_start", "_dropped")

    def __init__(self, log: Any, session: str) -> None:
        self._log, self._session = log, session
        self._items, self._dropped = log._events, log.dropped
        self._start = len(self._items)

    def close(self) -> None:
        """Mark what was recorded since, if anything (not after an overflow: the log's
        restatement names no session)."""
        items, start = self._items, self._start
        if len(items) > start and self._log.dropped == self._dropped and items is self._log._events:
            items.insert(start, SessionMark(self._session))
            items.append(SessionMark(None))


def _bracketing(call: Callable[..., Any], log: Any) -> Callable[..., Any]:
    def bracketed(request: Any, *args: Any, **kwargs: Any) -> Any:
        session = getattr(request, "session_id", None)
        if session is None:
            return call(request, *args, **kwargs)
        bracket = Bracket(log, session)
        try:
            return call(request, *args, **kwargs)
        finally:
            bracket.close()

    bracketed.__name__ = bracketed.__qualname__ = getattr(call, "__name__", "call")
    bracketed.__doc__ = call.__doc__
    return bracketed
