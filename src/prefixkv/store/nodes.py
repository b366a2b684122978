"""``Nodes``: the connections a ``RedisStore`` calls through, and where each key lives.

One server (its address: the URL's, or the master Sentinel names, followed through a
failover) or a Redis Cluster (a ``SlotMap`` read with CLUSTER SLOTS, dropped when a node
fails or a key moved, read again on the next call; nodes that failed asked last). Idle
``Resp`` connections are pooled per node, one per thread at a time. A key answered ``-ASK``
(its slot migrating) is asked again on the node named (``redirected``, ``ask_again``).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .resp import Address, Packed, Resp, RespError, pack
from .slot_map import Rounds, SlotMap


class Nodes:
    """The node (``cluster=False``: ``home``) or nodes serving a store's keys, and the idle
    connections to each. ``auth``: ``username``, ``password``, ``db`` and ``tls`` (an
    ``ssl.SSLContext`` or None), as ``Resp`` takes them. Thread-safe: fetcher threads
    take and give connections concurrently; the slot map is replaced whole."""

    def __init__(self, home: Address, *, cluster: bool, username: str | None,
                 password: str | None, db: int, tls: ssl.SSLContext | None) -> None:
        self.home = home
        self.cluster = cluster
        self._auth: dict[str, Any] = dict(username=username, password=password, db=db, tls=tls)
        self.idle: dict[Address, list[Resp]] = {}
        self._lock = threading.Lock()
        self.map = SlotMap()  # cluster: the node of each slot, the nodes, the suspects
        self.sentinel: tuple[Any, str] | None = None  # (redis-py Sentinel, service name)

    def rounds(self, keys: Sequence[bytes], deadline: float) -> Rounds:
        """The keys' indices by the node that serves them (on a cluster, the slot map is
        read first when there is none, by ``deadline``), in the rounds a call asks the
        nodes: the suspects last."""
        return self.map.rounds(self._groups(keys, deadline))

    def failed(self, node: Address, idx: list[int], out: list[Any], exc: Exception,
               fair: bool = True) -> Exception:
        """Keys ``idx`` failed with ``exc`` (their node is down or past the deadline):
        each gets the exception in ``out``; returns ``exc``. ``fair``: the node was asked
        with time left (a node asked once another had taken the whole deadline failed
        through no fault of its own: not suspect)."""
        for i in idx:
            out[i] = exc
        if self.cluster:
            self.map.slots = None  # a node went away: read the map again next time
            if fair:
                self.map.suspect(node)
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

    def send(self, node: Address, data: bytes | Sequence[Packed], deadline: float) -> Resp:
        """A connection to ``node`` (``take``) with ``data`` (packed commands) sent on
        it by ``deadline``. A connection the send failed on is closed before the error
        is raised: the server would still read, and answer, the part it got."""
        conn = self.take(node, deadline)
        try:
            conn.send(data, deadline)
        except BaseException:
            conn.close()
            raise
        return conn

    def give(self, conn: Resp) -> None:
        """``conn`` answered all it was asked: idle again, its node no longer suspect."""
        with self._lock:
            self.idle.setdefault(conn.address, []).append(conn)
        self.map.answered(conn.address)

    def follow(self) -> None:
        """Read from the master the sentinels name now (after a fetch failed as a whole:
        the master may have failed over); the old home's idle connections are closed.
        No master named (a failover under way, the sentinels down): the next failed
        fetch asks again. Nothing without Sentinel."""
        if self.sentinel is None:
            return
        sentinel, service = self.sentinel
        try:
            host, port = sentinel.discover_master(service)
        except Exception:
            return
        home: Address = ("tcp", host, int(port))
        if home != self.home:
            old, self.home = self.home, home
            with self._lock:
                stale = self.idle.pop(old, [])
            for conn in stale:
                conn.close()

    def redirected(self, reply: RespError, i: int, asks: dict[Address, list[int]]) -> None:
        """A key answered with an error: ``-ASK slot host:port`` (its slot is migrating and
        the key is on that node already) lists key ``i`` under that node in ``asks``, to be
        asked there; ``-MOVED`` (the slot moved) drops the slot map, read again on the next
        call. Other errors (WRONGTYPE) fail that key alone."""
        text = str(reply)
        if text.startswith("ASK "):
            host, _, port = text.split(" ")[-1].rpartition(":")
            if port.isdigit():
                asks.setdefault(("tcp", host or self.home[1], int(port)), []).append(i)
                return
        if text.startswith(("MOVED", "ASK")):
            self.map.slots = None  # resharded: read the map again next time

    def ask_again(self, asks: dict[Address, list[int]], command: Callable[[int], Packed],
                read: Callable[[Resp, int], object], out: list[Any], deadline: float) -> None:
        """Ask each node an ``-ASK`` reply named (``asks``: node -> key indices; a slot
        migrating, its key on that node already) for those keys again, each command
        behind an ``ASKING`` (Redis Cluster's redirection for one command), and put
        ``read(conn, i)``'s outcome in ``out[i]``. A node that fails fails those keys
        (their ASK error stays), as a node asked first does; the slot map stays (the
        slot is still its old master's until the migration ends: MOVED then)."""
        for node, idx in asks.items():
            try:
                conn = self.send(node, [c for i in idx for c in (_ASKING, command(i))], deadline)
            except Exception as exc:
                self.failed(node, [], out, exc)
                continue
            try:
                for i in idx:
                    ok = conn.reply(deadline)
                    outcome = read(conn, i)
                    if ok != b"OK" or isinstance(outcome, RespError):  # (moved again: a miss)
                        self.map.slots = None
                        outcome = outcome if isinstance(outcome, RespError) else RespError(str(ok))
                    out[i] = outcome
                self.give(conn)
            except Exception as exc:
                conn.close()
                self.failed(node, [], out, exc)

    def close(self) -> None:
        """Close every idle connection (a later call opens new ones)."""
        with self._lock:
            idle, self.idle = self.idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()

    def _groups(self, keys: Sequence[bytes], deadline: float) -> dict[Address, list[int]]:
        """The keys' indices by the node that serves them."""
        if not self.cluster:
            return {self.home: list(range(len(keys)))}
        from redis.crc import key_slot
        slots = self.map.slots or self._read_slots(deadline)
        groups: dict[Address, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(slots[key_slot(k)], []).append(i)
        return groups

    def _read_slots(self, deadline: float) -> list[Address]:
        """The cluster's slot map (CLUSTER SLOTS), from the first node that answers, in
        ``SlotMap.askers``' order. Raises the last failure when none answers."""
        failure: Exception = ConnectionError("no cluster node answered")
        for node in self.map.askers(self.home):
            conn = None
            try:
                conn = self.send(node, pack(b"CLUSTER", b"SLOTS"), deadline)
                ranges = conn.reply(deadline)
                self.give(conn)
            except Exception as exc:
                if conn is not None:
                    conn.close()
                self.map.suspect(node)
                failure = exc
                continue
            if isinstance(ranges, list):
                return self.map.learn(ranges, self.home)
        raise failure


_ASKING = pack(b"ASKING")
