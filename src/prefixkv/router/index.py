"""Which replica holds which block: the index protocol and its in-process backend.

A key is a block hash as it came off the wire (an int or bytes). A replica holds a key
on one or more media ("GPU", "CPU", ...). ``prefix_runs`` answers the one question a
router asks: for a prompt's block hashes, how long a run from the first block each
replica holds (on any medium, and on the GPU alone).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

Hash = int | bytes
GPU = "GPU"


class BlockIndex(Protocol):
    """Block hash -> replicas (with media). Implementations: InProcessIndex (default),
    RedisIndex (several routers share one), ApproxIndex (no events: routing decisions)."""

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """Record that ``replica`` holds ``hashes`` on ``medium`` (idempotent)."""

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """Forget ``hashes`` on ``replica``'s ``medium`` (unknown keys are ignored)."""

    def clear(self, replica: str) -> None:
        """Forget everything ``replica`` holds."""

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """For each of ``replicas`` holding ``hashes[0]``: ``(run, gpu_run)``, the number
        of leading hashes it holds on any medium and on the GPU. Others are left out."""

    def num_blocks(self, replica: str) -> int:
        """How many (hash, medium) entries ``replica`` has."""

    def routed(self, replica: str, hashes: Sequence[Hash]) -> None:
        """The router sent a prompt of ``hashes`` to ``replica``. Indexes fed by events
        ignore it; ``ApproxIndex`` (no events) learns from it."""


class InProcessIndex:
    """A dict per key: ``{hash: {replica: set of media}}`` plus each replica's keys (for
    ``clear``). Scoring intersects the holders of consecutive keys with set operations,
    so a 2k-token prompt (128 blocks of 16) costs ~128 C-level set intersections."""

    def __init__(self) -> None:
        self._holders: dict[Hash, dict[str, set[str]]] = {}
        self._keys: dict[str, set[Hash]] = {}
        self._gpu_only = True  # no other medium seen: gpu_run == run, one pass suffices

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.store``."""
        holders, keys = self._holders, self._keys.setdefault(replica, set())
        if medium != GPU:
            self._gpu_only = False
        for h in hashes:
            media = holders.setdefault(h, {}).setdefault(replica, set())
            media.add(medium)
        keys.update(hashes)

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.remove``."""
        holders, keys = self._holders, self._keys.get(replica)
        for h in hashes:
            by_replica = holders.get(h)
            media = by_replica.get(replica) if by_replica else None
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del by_replica[replica]  # type: ignore[union-attr]
                keys.discard(h)  # type: ignore[union-attr]
                if not by_replica:
                    del holders[h]

    def clear(self, replica: str) -> None:
        """See ``BlockIndex.clear``."""
        holders = self._holders
        for h in self._keys.pop(replica, ()):
            by_replica = holders[h]
            del by_replica[replica]
            if not by_replica:
                del holders[h]

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """See ``BlockIndex.prefix_runs``."""
        runs = _runs(self._holders, hashes, set(replicas), None)
        if self._gpu_only:
            return {r: (n, n) for r, n in runs.items()}
        gpu = _runs(self._holders, hashes, set(runs), GPU)
        return {r: (n, gpu.get(r, 0)) for r, n in runs.items()}

    def num_blocks(self, replica: str) -> int:
        """See ``BlockIndex.num_blocks``."""
        return sum(len(self._holders[h][replica]) for h in self._keys.get(replica, ()))

    def routed(self, replica: str, hashes: Sequence[Hash]) -> None:
        """See ``BlockIndex.routed``: ignored (the events say what the replica holds)."""


def _runs(holders: dict[Hash, dict[str, set[str]]], hashes: Sequence[Hash], active: set[str],
          medium: str | None) -> dict[str, int]:
    """Leading run of ``hashes`` held by each replica of ``active`` (on ``medium``, or any
    medium when None); replicas with a run of 0 are left out."""
    out: dict[str, int] = {}
    if not hashes:
        return out
    for i, h in enumerate(hashes):
        by_replica = holders.get(h)
        if by_replica is None:
            kept: set[str] = set()
        elif medium is None:
            kept = active.intersection(by_replica)
        else:
            kept = {r for r in active if medium in by_replica.get(r, ())}
        if len(kept) < len(active):
            for r in active - kept:
                if i:
                    out[r] = i
            active = kept
            if not active:
                return out
    for r in active:
        out[r] = len(hashes)
    return out
