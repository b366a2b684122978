"""Which replica holds which block: the index protocol and its in-process backend.

A key is a block hash as it came off the wire (an int or bytes). A replica holds a key
on one or more media ("GPU", "CPU", ...). ``prefix_runs`` answers the one question a
router asks: for a prompt's block hashes, how long a run from the first block each
replica holds (on any medium, and on the GPU alone).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from ..errors import ConfigError, PrefixKVError

Hash = int | bytes
GPU = "GPU"
MAX_PER_REPLICA = 1 << 21
"""``InProcessIndex``'s default cap on one replica's blocks (2,097,152: a large GPU pool
and a host tier many times its size)."""
MAX_MEDIA = 8
"""Media names one replica's blocks may be on in ``InProcessIndex`` (engines use two or
three: GPU, CPU, disk)."""
_log = logging.getLogger(__name__)
_HASH_TYPES = frozenset({int, bytes})  # exact types: a bool, a numpy int, a str are not hashes
_SEQUENCES = (list, tuple)


class BlockIndexError(PrefixKVError):
    """A call of an in-process index with a replica or medium name that is not a str,
    hashes that are not a list or tuple of block hashes (each an int, not a bool, or
    bytes: what ``decode_batch`` gives), or replicas that are not an iterable of names (a
    str is one name, not many). Raised before the index changes."""


def check_call(error: type[BlockIndexError], replica: object = "", hashes: object = (),
               medium: object = "") -> None:
    """Raise ``error`` for an index call's bad argument (``BlockIndexError``'s doc). A
    store that went on to fail at its first unhashable hash had indexed those before it;
    a str hash was indexed where no prompt's hash can match it."""
    if not isinstance(replica, str) or not isinstance(medium, str):
        raise error(f"replica and medium must be str names, got {_brief(replica)} and "
                    f"{_brief(medium)}")
    if hashes.__class__ not in _SEQUENCES or not _HASH_TYPES.issuperset(
            map(type, hashes)):
        odd = [h for h in hashes if type(h) not in _HASH_TYPES][:1] if isinstance(
            hashes, (list, tuple)) else [hashes]
        raise error(f"hashes must be a list or tuple of ints or bytes, got "
                    f"{type(hashes).__name__} holding {_brief(odd[0])}")


def checked_names(error: type[BlockIndexError], replicas: object) -> set[str]:
    """``replicas`` as a set of names; raises ``error`` if it is not an iterable of str."""
    if isinstance(replicas, str) or not isinstance(replicas, Iterable):
        raise error(f"replicas must be an iterable of names, got {_brief(replicas)}")
    names = list(replicas)
    odd = [r for r in names if not isinstance(r, str)]
    if odd:
        raise error(f"replicas must be str names, got {_brief(odd[0])}")
    return set(names)


def _brief(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


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
    so a 2k-token prompt (128 blocks of 16) costs ~128 C-level set intersections.

    ``max_per_replica``: blocks (distinct hashes) one replica may have (None: no cap; at
    ~500 bytes a block on one medium the default is ~1 GB), on at most ``MAX_MEDIA``
    media names. A store past either is not indexed, counted in ``refused`` (replica ->
    blocks), and logged once per replica: a publisher that announces without end (a
    defect, a hostile peer) cannot grow the router's memory without bound, and its index
    only understates. Raises ConfigError for a cap that is not an int >= 1 or None; each
    call raises BlockIndexError for an argument of the wrong type, before any change."""

    def __init__(self, max_per_replica: int | None = MAX_PER_REPLICA) -> None:
        if max_per_replica is not None and (isinstance(max_per_replica, bool) or not isinstance(
                max_per_replica, int) or max_per_replica < 1):
            raise ConfigError(f"max_per_replica must be an int >= 1 or None, "
                              f"got {max_per_replica!r}")
        self.max_per_replica = max_per_replica
        self.refused: dict[str, int] = {}
        self._holders: dict[Hash, dict[str, set[str]]] = {}
        self._keys: dict[str, set[Hash]] = {}
        self._media: dict[str, set[str]] = {}  # media names each replica used
        self._gpu_only = True  # no other medium seen: gpu_run == run, one pass suffices

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.store``; past ``max_per_replica`` blocks or ``MAX_MEDIA``
        media, not indexed (class doc)."""
        if (replica.__class__ is not str or medium.__class__ is not str or hashes.__class__
                not in _SEQUENCES or not _HASH_TYPES.issuperset(map(type, hashes))):
            check_call(BlockIndexError, replica, hashes, medium)  # (the path of every event)
        holders, keys = self._holders, self._keys.setdefault(replica, set())
        media_used = self._media.setdefault(replica, set())
        if medium not in media_used:
            if len(media_used) >= MAX_MEDIA:
                self._refuse(replica, len(hashes))
                return
            media_used.add(medium)
        if medium != GPU:
            self._gpu_only = False
        cap = self.max_per_replica
        if cap is None or len(keys) + len(hashes) <= cap:  # (far from the cap: no check each)
            for h in hashes:
                holders.setdefault(h, {}).setdefault(replica, set()).add(medium)
            keys.update(hashes)
            return
        for i, h in enumerate(hashes):
            if h not in keys:
                if len(keys) >= cap:
                    self._refuse(replica, len(hashes) - i)
                    return
                keys.add(h)
            holders.setdefault(h, {}).setdefault(replica, set()).add(medium)

    def _refuse(self, replica: str, n: int) -> None:
        if not self.refused.get(replica):
            _log.warning("replica %r announces more than %d blocks or %d media: the rest are "
                         "not indexed (InProcessIndex max_per_replica)", replica,
                         self.max_per_replica, MAX_MEDIA)
        self.refused[replica] = self.refused.get(replica, 0) + n

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.remove``."""
        if (replica.__class__ is not str or medium.__class__ is not str or hashes.__class__
                not in _SEQUENCES or not _HASH_TYPES.issuperset(map(type, hashes))):
            check_call(BlockIndexError, replica, hashes, medium)  # (the path of every event)
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
        check_call(BlockIndexError, replica)
        holders = self._holders
        self._media.pop(replica, None)
        for h in self._keys.pop(replica, ()):
            by_replica = holders[h]
            del by_replica[replica]
            if not by_replica:
                del holders[h]

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """See ``BlockIndex.prefix_runs``."""
        check_call(BlockIndexError, hashes=hashes)
        runs = _runs(self._holders, hashes, checked_names(BlockIndexError, replicas), None)
        if self._gpu_only:
            return {r: (n, n) for r, n in runs.items()}
        gpu = _runs(self._holders, hashes, set(runs), GPU)
        return {r: (n, gpu.get(r, 0)) for r, n in runs.items()}

    def num_blocks(self, replica: str) -> int:
        """See ``BlockIndex.num_blocks``."""
        check_call(BlockIndexError, replica)
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
