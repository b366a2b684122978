"""``Nodes``: the connections ``RedisStore`` reads through, and where each key lives.

One server (its address: the URL's, or the master Sentinel names) or a Redis Cluster
(a slot map read with CLUSTER SLOTS, dropped when a node fails or a key moved, read again
on the next call from any node an earlier map named). Idle ``Resp`` connections are
pooled per node, one per thread at a time.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from typing import Any

from .resp import Address, Resp, pack

CLUSTER_SLOTS = 16384
"""Hash slots of a Redis Cluster (``redis.crc.key_slot`` maps a key to one)."""


class Nodes:
    """The node (``cluster=False``: ``home``) or nodes serving a store's keys, and the idle
    connections to each. ``auth``: ``username``, ``password``, ``db`` and ``tls`` (an
    ``ssl.SSLContext`` or None), as ``Resp`` takes them. Thread-safe: fetcher threads take
    and give connections concurrently; the slot map is replaced whole, never edited."""

    def __init__(self, home: Address, *, cluster: bool, username: str | None,
                 password: str | None, db: int, tls: ssl.SSLContext | None) -> None:
        self.home = home
        self.cluster = cluster
        self._auth: dict[str, Any] = dict(username=username, password=password, db=db, tls=tls)
        self.idle: dict[Address, list[Resp]] = {}
        self._lock = threading.Lock()
        self._slots: list[Address] | None = None  # cluster: the node of each slot
        # cluster: every node a slot map named, kept when the map is dropped: the map is
        # read again from any of them, so a dead home node does not take the store down
        self._known: set[Address] = set()

    def forget_slots(self) -> None:
        """Read the slot map again on the next call (a node failed, a key moved)."""
        self._slots = None

    def failed(self, idx: list[int], out: list[Any], exc: Exception) -> Exception:
        """Keys ``idx`` failed with ``exc`` (their node is down or past the deadline):
        each gets the exception in ``out``; returns ``exc``."""
        for i in idx:
            out[i] = exc
        if self.cluster:
            self._slots = None  # a node went away: read the map again next time
        return exc

    def take(self, node: Address, deadline: float) -> Resp:
        """An idle connection to ``node`` that is still open (one the server closed,
        say by a restart while it was idle, is dropped: its first use would fail the
        whole call), else a new one, opened by ``deadline``."""
        while True:
            with self._lock:
                idle = self.idle.get(node)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if conn.idle_ok():
                return conn
            conn.close()
        conn = Resp(node, **self._auth)
        conn.open(deadline)
        return conn

    def give(self, conn: Resp) -> None:
        """Pool ``conn`` (its replies all read) for the next call to its node."""
        with self._lock:
            self.idle.setdefault(conn.address, []).append(conn)

    def move_home(self, home: Address) -> None:
        """The server moved (a Sentinel failover): later calls go to ``home``; the old
        home's idle connections are closed."""
        if home == self.home:
            return
        old, self.home = self.home, home
        with self._lock:
            stale = self.idle.pop(old, [])
        for conn in stale:
            conn.close()

    def close(self) -> None:
        """Close every idle connection (a later call opens new ones)."""
        with self._lock:
            idle, self.idle = self.idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()

    def groups(self, keys: Sequence[bytes], deadline: float) -> dict[Address, list[int]]:
        """The keys' indices by the node that serves them (on a cluster, the slot map is
        read first when there is none, by ``deadline``)."""
        if not self.cluster:
            return {self.home: list(range(len(keys)))}
        from redis.crc import key_slot
        slots = self._slots or self._read_slots(deadline)
        groups: dict[Address, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(slots[key_slot(k)], []).append(i)
        return groups

    def _read_slots(self, deadline: float) -> list[Address]:
        """The cluster's slot map (CLUSTER SLOTS), from the first node that answers: the
        URL's node, then every node an earlier map named. Raises the last failure when
        none answers."""
        nodes = [self.home, *sorted(self._known - {self.home})]
        failure: Exception = ConnectionError("no cluster node answered")
        for node in nodes:
            try:
                conn = self.take(node, deadline)
                conn.send(pack(b"CLUSTER", b"SLOTS"), deadline)
                ranges = conn.reply(deadline)
                self.give(conn)
            except Exception as exc:
                failure = exc
                continue
            if isinstance(ranges, list):
                slots: list[Address] = [self.home] * CLUSTER_SLOTS
                for lo, hi, master, *_ in ranges:
                    host = master[0].decode() or self.home[1]
                    slots[lo:hi + 1] = [("tcp", host, int(master[1]))] * (hi - lo + 1)
                self._slots = slots
                self._known.update(slots)
                return slots
        raise failure
