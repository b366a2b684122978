"""One request's resident row: the state of each page of a HiSparse resident group, a
write-back cache on the GPU of KV whose primary copy is on the host.

    page:    0 .. len - TAIL - 1                          | len - TAIL .. len - 1
    state:   DIRTY -> IN_FLIGHT -> CLEAN -> UNPINNED -> HOST | DIRTY -> IN_FLIGHT -> CLEAN

The states are ``PageState``'s. Only a row that can read from host (its hot region is
held) unpins, and never its last ``TAIL`` pages.

``ready`` is the length of the prefix whose host copy is valid (CLEAN, UNPINNED or
HOST). The rules are vLLM 0.33's (``v1/hisparse/coordinator.py``), written here and
checked against tests/engines/hisparse_model.py by tests/engines/test_hisparse_row.py.
Scope: the reference's. Pages come from steps; from external loads
(tests/engines/hisparse_import_model.py): an import's pages but its last are HOST from the
start (``pad``: read from host, never on the GPU), and its last page is restored from
host (``restore``, then ``confirm`` when the page is whole, ``restored`` when it is not);
or HOST from a hit on the host prefix (``start_host``; a HOST page may be ``adopt``ed back
from a GPU copy). The row decides, and the pool and the transfers are its caller's. Caller mistakes raise
RequestError before any change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ...errors import InvariantError, RequestError, check_count

__all__ = ["TAIL", "FreeSplit", "PageState", "ResidentRow"]


class PageState(IntEnum):
    """The state of a resident page. DIRTY: its KV is on the GPU only. IN_FLIGHT: a copy
    to host is planned or sent. CLEAN: the workers confirmed the copy; the GPU block is
    still held. UNPINNED: the GPU block went back to the pool (counted free) and is still
    read until the pool hands it out. HOST: the pool handed it out (the page is lost); it
    is read from host."""

    DIRTY = 0
    IN_FLIGHT = 1
    CLEAN = 2
    UNPINNED = 3
    HOST = 4


DIRTY, IN_FLIGHT, CLEAN, UNPINNED, HOST = PageState
_VALID = (CLEAN, UNPINNED, HOST)

TAIL = 2
"""The row's last pages, never unpinned: a step in flight may still write them (vLLM's
``ACTIVE_TAIL_PAGES``)."""


@dataclass(frozen=True, slots=True)
class FreeSplit:
    """What freeing the row does with each GPU block it holds. ``to_tail``: clean pages,
    tail first; their blocks go to the free queue's tail (kept readable for a later hit).
    ``to_head``: dirty pages, their blocks given back with the group's others.
    ``kept``: pages in flight, whose blocks (GPU and host) wait for the copy's
    confirmation. Unpinned and host pages hold nothing of the row's any more."""

    to_tail: tuple[int, ...]
    to_head: tuple[int, ...]
    kept: tuple[int, ...]


class ResidentRow:
    """The pages of one request's resident row, each in one ``PageState``. ``ready``: the
    length of the prefix with a valid host copy. ``hot``: whether the request holds its hot
    region (may read from host). Only such a row unpins, and never its last ``TAIL`` pages."""

    __slots__ = ("_states", "ready", "hot")

    def __init__(self) -> None:
        self._states: list[PageState] = []
        self.ready = 0  # pages 0 .. ready - 1 have a valid host copy
        self.hot = False  # the request holds its hot region: it can read from host

    def __len__(self) -> int:
        return len(self._states)

    def state(self, page: int) -> PageState:
        """The state of ``page`` (RequestError when the row has no such page)."""
        return self._states[check_count("page", page, 0, len(self._states) - 1)]

    def pages(self, state: PageState) -> list[int]:
        """The row's pages in ``state``, in page order."""
        return [p for p, s in enumerate(self._states) if s == state]

    def grow(self, n: int) -> None:
        """Append ``n`` DIRTY pages (a step's new GPU pages)."""
        self._states += [DIRTY] * check_count("n", n, 0, None)

    def pad(self, n: int) -> None:
        """Append ``n`` HOST pages: an import's pages read from host, never on the GPU."""
        self._states += [HOST] * check_count("n", n, 0, None)
        while self.ready < len(self._states) and self._states[self.ready] in _VALID:
            self.ready += 1

    def start_host(self, n: int) -> None:
        """An empty row starts with ``n`` HOST pages: a hit on the host prefix (valid,
        read from host until a GPU copy is adopted)."""
        if self._states:
            raise RequestError(f"a row of {len(self._states)} pages cannot start with a hit")
        self._states = [HOST] * check_count("n", n, 0, None)
        self.ready = n

    def adopt(self, page: int) -> None:
        """A HOST page is read from a GPU copy of its content again: CLEAN (held)."""
        self._expect(page, HOST, "adopt")
        self._states[page] = CLEAN

    def hold_hot(self) -> None:
        """The request took its hot region: it may read from host from now on."""
        self.hot = True

    def asks_for_hot(self, free: int, watermark: int, window: int) -> bool:
        """Whether a row without its hot region asks for one after a step: the pool has
        fewer than ``watermark`` free blocks (vLLM's ``max(hot blocks per request,
        num_blocks // 10)``), or the row holds its admission ``window`` of pages. A row
        that holds its hot region asks for nothing."""
        check_count("free", free, 0, None)
        return not self.hot and (free < watermark or len(self._states) >= window)

    def plan(self, sealed: int, budget: int, start: int = 0) -> list[int]:
        """Mark IN_FLIGHT, and return in page order, the DIRTY pages from ``ready`` (and
        ``start``: an import's end) below ``sealed`` (the pages the computed tokens fill),
        at most ``budget`` of them: the copies the step plans."""
        check_count("sealed", sealed, 0, len(self._states))
        check_count("budget", budget, 0, None)
        out = [p for p in range(max(self.ready, start), sealed) if self._states[p] == DIRTY][:budget]
        for p in out:
            self._states[p] = IN_FLIGHT
        return out

    def restore(self, page: int) -> None:
        """A copy from host to ``page`` (an import's last page) is planned: IN_FLIGHT."""
        self._expect(page, DIRTY, "restore")
        self._states[page] = IN_FLIGHT

    def restored(self, page: int) -> None:
        """The workers confirmed the restore of a page that is not whole: DIRTY (its KV
        is on the GPU only until the steps fill it and it is copied)."""
        self._expect(page, IN_FLIGHT, "restored")
        self._states[page] = DIRTY

    def confirm(self, page: int) -> bool:
        """The workers confirmed ``page``'s copy: CLEAN (and ``ready`` moves past a valid
        prefix). Returns whether the page may be unpinned now (``unpinnable``'s rule)."""
        self._expect(page, IN_FLIGHT, "confirm")
        self._states[page] = CLEAN
        while self.ready < len(self._states) and self._states[self.ready] in _VALID:
            self.ready += 1
        return self.hot and page < len(self._states) - TAIL

    def unpinnable(self) -> list[int]:
        """The CLEAN pages the row unpins now, tail first: none unless the hot region is
        held, and none of the last ``TAIL``."""
        if not self.hot:
            return []
        return [p for p in reversed(range(len(self._states) - TAIL)) if self._states[p] == CLEAN]

    def unpin(self, page: int) -> None:
        """``page``'s GPU block went back to the pool, still readable: UNPINNED."""
        self._expect(page, CLEAN, "unpin")
        if not self.hot or page >= len(self._states) - TAIL:
            raise RequestError(f"page {page} of {len(self._states)} may not be unpinned "
                               f"(hot region held: {self.hot}; the last {TAIL} never are)")
        self._states[page] = UNPINNED

    def lose(self, page: int) -> None:
        """The pool handed ``page``'s unpinned block out: HOST, read from host from now on."""
        self._expect(page, UNPINNED, "lose")
        self._states[page] = HOST

    def free(self) -> FreeSplit:
        """The request goes: what becomes of each GPU block the row holds (``FreeSplit``).
        The row is empty afterwards."""
        states = self._states
        split = FreeSplit(tuple(p for p in reversed(range(len(states))) if states[p] == CLEAN),
                          tuple(p for p, s in enumerate(states) if s == DIRTY),
                          tuple(p for p, s in enumerate(states) if s == IN_FLIGHT))
        self._states, self.ready, self.hot = [], 0, False
        return split

    def _expect(self, page: int, state: PageState, what: str) -> None:
        if self.state(page) != state:
            raise RequestError(f"cannot {what} page {page}: it is {self._states[page].name}, "
                               f"not {state.name}")

    def check_invariants(self) -> None:
        """Raise InvariantError when the states break the rules of the module docstring."""
        states, n = self._states, len(self._states)
        if any(not isinstance(s, PageState) for s in states):
            raise InvariantError(f"unknown page state in {states}")
        ready = 0
        while ready < n and states[ready] in _VALID:
            ready += 1
        if self.ready != ready:
            raise InvariantError(f"ready is {self.ready}, the valid prefix {ready}")
        off_gpu = [p for p, s in enumerate(states) if s in (UNPINNED, HOST)]
        if off_gpu and not self.hot:
            raise InvariantError(f"pages {off_gpu} unpinned or lost without a hot region")
        unpinned = [p for p in off_gpu if states[p] == UNPINNED]  # (a HOST page among the
        if unpinned and unpinned[-1] >= n - TAIL:  # last may come from an import or a hit)
            raise InvariantError(f"page {unpinned[-1]} of {n} unpinned among the last {TAIL}")
