"""An index for engines that publish no KV events: the router's own decisions.

When the router sends a prompt to a replica, that replica will soon hold the prompt's
full blocks; ``ApproxIndex`` records them there for ``ttl`` seconds (as NVIDIA Dynamo's
ApproxKvIndexer does), after which they are forgotten unless routed again (a later
prompt sharing the prefix renews them). It is a guess: a replica may have evicted the
blocks sooner, or kept them longer; the TTL bounds how stale a guess can be.

The TTL is counted in the clock's forward motion: a reading below the last one (an
injected clock stepped back) counts as no time passing (``steps_back`` counts them).
Taken at face value, a step back of a day kept every guess made before it for a day
more, and a guess made after it waited in the expiry queue behind those. A reading that
is not a finite number raises ApproxIndexError before anything changes (a NaN compares
false with every expiry: nothing would expire again).

Events, if some replica does send them, are applied as by ``InProcessIndex`` (a stored
block is held until removed, without TTL).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from .clock import ForwardClock
from .index import GPU, BlockIndexError, Hash, InProcessIndex, check_call, checked_names


class ApproxIndexError(BlockIndexError):
    """A TTL that is not a positive number (a bool is not one), a clock reading that is
    not a finite number, or a call's argument of the wrong type (``BlockIndexError``)."""


class ApproxIndex:
    """Satisfies ``BlockIndex``. ``ttl``: seconds a routed prompt's blocks count as held
    (> 0); ``clock``: seconds (tests pass a fake one; a step back counts as no time, module
    doc). Raises ApproxIndexError for a bad ``ttl``; every call raises it, before any
    change, for an argument of the wrong type, and every call that reads the clock for a
    reading that is not a finite number."""

    def __init__(self, ttl: float = 120.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0):
            raise ApproxIndexError(f"ttl must be a number of seconds > 0, got {ttl!r}")
        self.ttl, self.clock = float(ttl), clock
        self._index = InProcessIndex()
        self._until: dict[tuple[str, Hash], float] = {}  # (replica, hash) -> expiry
        self._queue: deque[tuple[float, str, Sequence[Hash]]] = deque()  # in expiry order
        # stored by an event, on these media: no TTL (until every medium is removed)
        self._held: dict[tuple[str, Hash], set[str]] = {}
        self._time = ForwardClock(clock, ApproxIndexError)  # (clock.py)

    @property
    def refused(self) -> dict[str, int]:
        """Blocks not indexed per replica: its entries at ``InProcessIndex``'s cap
        (``max_per_replica``, the default; guesses and events alike)."""
        return self._index.refused

    @property
    def steps_back(self) -> int:
        """How many clock readings were below the one before (counted as no time)."""
        return self._time.steps_back

    def routed(self, replica: str, hashes: Sequence[Hash]) -> None:
        """Count ``hashes`` as held by ``replica`` (on the GPU) for ``ttl`` from now."""
        check_call(ApproxIndexError, replica, hashes)
        if not hashes:
            return
        until, held = self._expire() + self.ttl, self._held
        # once each: a hash twice in the queue entry was deleted twice on expiry (KeyError)
        guessed = self._indexed(replica, [h for h in dict.fromkeys(hashes)
                                          if (replica, h) not in held], GPU)
        self._until.update(((replica, h), until) for h in guessed)
        self._queue.append((until, replica, guessed))

    def _indexed(self, replica: str, hashes: Sequence[Hash], medium: str) -> Sequence[Hash]:
        """Store ``hashes`` in the inner index; returns those it took. Past its cap it
        refuses the rest of a store from the first block it cannot take (``refused``
        counts them): they are not kept here either, or this index's own books (media,
        expiries) grew without bound past the cap meant to bound the router's memory."""
        before = self._index.refused.get(replica, 0)
        self._index.store(replica, hashes, medium)
        refused = self._index.refused.get(replica, 0) - before
        return hashes[:len(hashes) - refused] if refused else hashes

    def _expire(self) -> float:
        """Forget the blocks whose last routing is ``ttl`` old; returns the time now."""
        now, queue, until = self._time(), self._queue, self._until
        while queue and queue[0][0] <= now:
            _, replica, hashes = queue.popleft()
            gone = [h for h in hashes if until.get((replica, h), now + 1) <= now]
            for h in gone:
                del until[(replica, h)]
            self._index.remove(replica, gone, GPU)
        return now

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.store``: held on ``medium`` until removed. An event outranks
        a guess: a block guessed on the GPU is then where the event says, and only there
        (a guess kept without its TTL would outlive every event)."""
        check_call(ApproxIndexError, replica, hashes, medium)
        guessed = [h for h in hashes if self._until.pop((replica, h), None) is not None]
        self._index.remove(replica, guessed, GPU)
        for h in self._indexed(replica, hashes, medium):
            self._held.setdefault((replica, h), set()).add(medium)

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.remove``: a block stays held while an event says it is on
        another medium (a later guess must not expire it)."""
        check_call(ApproxIndexError, replica, hashes, medium)
        held, guess = self._held, medium == GPU  # a guess is on the GPU: other media keep it
        for h in hashes:
            if guess:
                self._until.pop((replica, h), None)
            media = held.get((replica, h))
            if media is not None:
                media.discard(medium)
                if not media:
                    del held[(replica, h)]
        self._index.remove(replica, hashes, medium)

    def clear(self, replica: str) -> None:
        """See ``BlockIndex.clear``."""
        check_call(ApproxIndexError, replica)
        self._until = {k: t for k, t in self._until.items() if k[0] != replica}
        self._held = {k: m for k, m in self._held.items() if k[0] != replica}
        self._index.clear(replica)

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """See ``BlockIndex.prefix_runs`` (guesses older than ``ttl`` are gone)."""
        check_call(ApproxIndexError, hashes=hashes)
        names = checked_names(ApproxIndexError, replicas)
        self._expire()
        return self._index.prefix_runs(hashes, names)

    def num_blocks(self, replica: str) -> int:
        """See ``BlockIndex.num_blocks``."""
        check_call(ApproxIndexError, replica)
        self._expire()
        return self._index.num_blocks(replica)
