"""The copies of resident pages to host, of every request, from planned to confirmed:
what vLLM 0.33's HiSparse coordinator keeps as ``spills_to_send`` and ``pending_spills``.

    planned (to_send, at most max_pages) --take--> sent --report...--> confirmed
                  \\______________ the request freed: detached (still confirmed later) __/

A copy is confirmed once as many workers completed it as the first enqueued report for
it said. Reports on copies no longer in flight are ignored, as vLLM's. Checked against
tests/engines/hisparse_model.py by tests/engines/test_hisparse_row.py. The pages' states
are ``row.ResidentRow``'s; the blocks the copies hold are their caller's. Caller
mistakes raise RequestError before any change.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

from ...errors import InvariantError, RequestError, check_count

__all__ = ["Spills"]


class Spills:
    """Copies to host in flight. ``max_pages``: the most planned and not yet sent (vLLM's
    ``max_model_len // block_size``). Transfer ids count up from 0."""

    __slots__ = ("max_pages", "to_send", "_next", "_page", "_counts")

    def __init__(self, max_pages: int) -> None:
        self.max_pages = check_count("max_pages", max_pages, 0, None)
        self.to_send: list[int] = []  # planned, not yet taken to the workers
        self._next = 0
        self._page: dict[int, tuple[Hashable | None, int]] = {}  # id -> (request or None, page)
        self._counts: dict[int, list[int]] = {}  # id -> [workers, completions so far]

    @property
    def budget(self) -> int:
        """How many more copies a step may plan now."""
        return max(self.max_pages - len(self.to_send), 0)

    @property
    def in_flight(self) -> int:
        """Copies planned and not yet confirmed (detached ones too)."""
        return len(self._page)

    def __contains__(self, tid: object) -> bool:
        """Whether copy ``tid`` is in flight (planned, not yet confirmed)."""
        return tid in self._page

    def has_work(self) -> bool:
        """Whether a copy is still to be sent or confirmed (vLLM's ``has_pending_work``,
        less host copy-on-write)."""
        return bool(self.to_send or self._page)

    @property
    def flight(self) -> Mapping[int, tuple[Hashable | None, int]]:
        """The copies in flight, read-only and live: id -> (request or None once
        detached, page)."""
        return MappingProxyType(self._page)

    def owners(self) -> list[Hashable | None]:
        """The request of each copy in flight (None once detached), in id order."""
        return [k for k, _ in self._page.values()]

    def page_of(self, tid: int) -> tuple[Hashable | None, int]:
        """(request, page) of copy ``tid`` in flight; request None once detached."""
        if tid not in self._page:
            raise RequestError(f"no copy {tid!r} in flight")
        return self._page[tid]

    def plan(self, key: Hashable, pages: Sequence[int], budgeted: bool = True) -> list[int]:
        """Plan a copy of each of ``key``'s ``pages`` (at most ``budget`` unless not
        ``budgeted``: an import's restore); their ids."""
        if budgeted and len(pages) > self.budget:
            raise RequestError(f"{len(pages)} copies planned, {self.budget} may be")
        out = list(range(self._next, self._next + len(pages)))
        self._next += len(pages)
        self._page.update(zip(out, ((key, p) for p in pages), strict=True))
        self.to_send += out
        return out

    def take(self) -> list[int]:
        """The copies planned since the last take, in order (the step's offload command)."""
        out, self.to_send = self.to_send, []
        return out

    def report(self, enqueued: Mapping[int, int], completed: Mapping[int, int]) -> list[int]:
        """The workers' reports: how many will complete each copy (its first report
        counts) and how many did. Returns the copies confirmed now, in id order; they
        leave the flight (``page_of`` before this call says whose they were)."""
        for counts in (enqueued, completed):
            for n in counts.values():
                check_count("a worker count", n, 0, None)
        for tid, n in enqueued.items():
            if tid in self._page:
                c = self._counts.setdefault(tid, [0, 0])
                c[0] = c[0] or n
        for tid, n in completed.items():
            if tid in self._page:
                self._counts.setdefault(tid, [0, 0])[1] += n
        done = sorted(t for t, (workers, seen) in self._counts.items() if 0 < workers <= seen)
        for tid in done:
            del self._counts[tid], self._page[tid]
        return done

    def detach(self, key: Hashable) -> list[int]:
        """``key`` was freed: its copies in flight go on, owned by no request. Their ids."""
        out = [t for t, (k, _) in self._page.items() if k == key]
        for tid in out:
            self._page[tid] = (None, self._page[tid][1])
        return out

    def check_invariants(self) -> None:
        """Raise InvariantError when the bookkeeping is inconsistent."""
        if not set(self.to_send) <= set(self._page) or not set(self._counts) <= set(self._page):
            raise InvariantError(f"copies to send {self.to_send} or counted {sorted(self._counts)} "
                                 f"not in flight ({sorted(self._page)})")
        if any(t >= self._next for t in self._page) or self.to_send != sorted(set(self.to_send)):
            raise InvariantError(f"ids out of order: next {self._next}, to send {self.to_send}")
