"""The block index in Redis/Valkey, shared by several router instances (extra
``prefixkv[redis]``: redis-py; any server speaking the Redis protocol).

Keys, under ``namespace`` (one per fleet: model, block size, hash mode and seed)::

    {ns}:b:{key}      SET of "{replica}|{medium}" holding the block
    {ns}:r:{replica}  SET of "{key}|{medium}" the replica holds (for clear)

``key`` is the wire hash: decimal for an int, ``x`` + hex for bytes. Writes are
pipelined (one round trip per batch of events); ``prefix_runs`` fetches every block's
holders in one pipelined round trip and computes the runs here.

One writer per namespace: let exactly one router instance subscribe and apply events
(others only route), so that the order of events per replica is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .index import Hash, _runs


def _key(h: Hash) -> str:
    return str(h) if isinstance(h, int) else "x" + h.hex()


class RedisIndex:
    """A BlockIndex over a ``redis.Redis`` client (``decode_responses`` either way)."""

    def __init__(self, client: object, namespace: str = "prefixkv") -> None:
        self.client = client
        self.ns = namespace

    def _members(self, replica: str, hashes: Sequence[Hash], medium: str, op: str) -> None:
        pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
        keys = [_key(h) for h in hashes]
        if not keys:
            return
        member = f"{replica}|{medium}"
        for k in keys:
            getattr(pipe, op)(f"{self.ns}:b:{k}", member)
        getattr(pipe, op)(f"{self.ns}:r:{replica}", *[f"{k}|{medium}" for k in keys])
        pipe.execute()

    def store(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.store``."""
        self._members(replica, hashes, medium, "sadd")

    def remove(self, replica: str, hashes: Sequence[Hash], medium: str) -> None:
        """See ``BlockIndex.remove``."""
        self._members(replica, hashes, medium, "srem")

    def clear(self, replica: str) -> None:
        """See ``BlockIndex.clear``."""
        rkey = f"{self.ns}:r:{replica}"
        held = self.client.smembers(rkey)  # type: ignore[attr-defined]
        pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
        for raw in held:
            entry = raw.decode() if isinstance(raw, bytes) else raw
            key, medium = entry.rsplit("|", 1)
            pipe.srem(f"{self.ns}:b:{key}", f"{replica}|{medium}")
        pipe.delete(rkey)
        pipe.execute()

    def prefix_runs(self, hashes: Sequence[Hash], replicas: Iterable[str]
                    ) -> dict[str, tuple[int, int]]:
        """See ``BlockIndex.prefix_runs``."""
        if not hashes:
            return {}
        pipe = self.client.pipeline(transaction=False)  # type: ignore[attr-defined]
        for h in hashes:
            pipe.smembers(f"{self.ns}:b:{_key(h)}")
        holders: dict[Hash, dict[str, set[str]]] = {}
        for h, members in zip(hashes, pipe.execute()):
            if not members:
                break  # no one holds it: the runs end here
            by_replica: dict[str, set[str]] = {}
            for raw in members:
                entry = raw.decode() if isinstance(raw, bytes) else raw
                replica, medium = entry.rsplit("|", 1)
                by_replica.setdefault(replica, set()).add(medium)
            holders[h] = by_replica
        runs = _runs(holders, hashes, set(replicas), None)
        gpu = _runs(holders, hashes, set(runs), "GPU")
        return {r: (n, gpu.get(r, 0)) for r, n in runs.items()}

    def num_blocks(self, replica: str) -> int:
        """See ``BlockIndex.num_blocks``."""
        return int(self.client.scard(f"{self.ns}:r:{replica}"))  # type: ignore[attr-defined]
