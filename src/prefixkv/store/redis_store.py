"""``RedisStore``: the store protocol on Redis or Valkey (the ``prefixkv[store]`` extra:
redis-py, with hiredis when installed; imported when a RedisStore is made, never by the
core).

Every call goes through ``Resp`` connections of prefixkv's own, pooled, one per thread
at a time, and is bounded by one deadline for the whole call: reads (``read_into``) are
pipelined GETs, each value received straight into its buffers; writes pipelined ``SET
... EX``, each value sent from its own buffer; existence checks pipelined ``EXISTS``
(redis-py, the client under ``client``, bounds each read, not a call: a server that
trickles held a call for seconds; its cluster pipeline fails the whole batch when one
node is down). On a Redis Cluster, keys carry no hash tag, so a
chain's blocks spread over the slots; a call sends each node its keys first, then reads
the nodes' replies: one round trip per node involved, overlapping. A key the cluster
moved (MOVED, resharding done) or a node that is down fails its keys (misses, refused
writes) and the slot map is read again on the next call; a key of a slot that is
migrating (ASK) is asked again on the node the reply names (``ASKING``, one more round
trip for such keys), and the map is kept. Found through Sentinel
(``from_sentinel``), a store follows a failover: a call that fails as a whole (a write
also when refused as a whole) asks the sentinels for the master again.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

from .fetch import YIELD_EVERY
from .nodes import Nodes
from .protocol import ReadOutcome
from .redis_args import check_items, check_keys, check_reads, check_runs, check_sentinels, check_store_args
from .resp import Address, Packed, Resp, RespError, pack, pack_set

WRITE_FLOOR: Final = 64 << 20
"""Bytes a second below which ``RedisStore.put`` gives up on a server: a write's
deadline is its ``timeout`` plus a second for each ``WRITE_FLOOR`` bytes of values."""


class RedisStore:
    """A Redis/Valkey server (or cluster) at ``url``: ``redis://host:port/db``,
    ``rediss://user:password@host:port`` (TLS, ACL user), ``unix:///path/redis.sock``.
    ``timeout``: seconds a connect or a write may take before it fails (a read's bound
    is its caller's deadline). ``ttl``: seconds a value lives. ``cluster``: the URL names
    a Redis Cluster node. ``ca_certs``: for rediss://, the PEM file of the certificate
    authorities to trust (default: the system's); the server's name or IP must match its
    certificate.
    Raises ConfigError for a timeout or ttl out of range, a URL that is not a str of
    those schemes or does not name one server and one database (``check_url``), a
    ``cluster`` that is not a bool or an empty ``ca_certs``, all before redis-py is
    imported; ImportError without redis-py."""

    def __init__(self, url: str, *, timeout: float = 0.25, ttl: int = 86400,
                 cluster: bool = False, ca_certs: str | None = None) -> None:
        check_store_args(url, timeout, ttl, cluster, ca_certs)
        import redis
        from redis.backoff import NoBackoff
        from redis.connection import SSLConnection, parse_url
        from redis.retry import Retry

        options: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout)
        if ca_certs is not None:
            options["ssl_ca_certs"] = ca_certs
        if cluster:
            from redis.cluster import RedisCluster
            self.client: Any = RedisCluster.from_url(url, **options)
        else:
            self.client = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)
        self.ttl, self.cluster, self.timeout = ttl, cluster, float(timeout)
        parts = parse_url(url)  # type: ignore[no-untyped-call]
        secure = parts.get("connection_class") is SSLConnection
        home: Address = (("unix", parts["path"]) if "path" in parts
                         else ("tcp", parts.get("host", "localhost"), int(parts.get("port", 6379))))
        self._nodes = Nodes(home, cluster=cluster, username=parts.get("username"),
                            password=parts.get("password"), db=int(parts.get("db") or 0),
                            tls=ssl.create_default_context(cafile=ca_certs) if secure else None)

    @classmethod
    def from_sentinel(cls, sentinels: Sequence[tuple[str, int]], service: str, *, db: int = 0,
                      password: str | None = None, timeout: float = 0.25, ttl: int = 86400,
                      cluster: bool = False, ca_certs: str | None = None) -> RedisStore:
        """A store on the master that Redis Sentinel names for ``service``, asked of the
        first of ``sentinels`` (``(host, port)``) that answers; ``timeout``, ``ttl``,
        ``cluster``, ``ca_certs`` as the constructor's. It follows a failover: writes go
        through redis-py's sentinel-managed client (a new connection asks for the
        master), and a fetch that
        fails as a whole asks the sentinels again (on the fetcher's thread) before it
        raises, so the next fetch reads from the master they name then. Raises
        redis-py's MasterNotFoundError when no sentinel knows the service; ConfigError,
        before any connection, unless ``sentinels`` is a non-empty list of ``(host,
        port)`` pairs (a non-empty str, an int in 1..65535) and ``service`` a non-empty
        str."""
        check_sentinels(sentinels, service)
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        from redis.sentinel import Sentinel

        sentinel = Sentinel(list(sentinels),  # type: ignore[no-untyped-call]
                            socket_timeout=timeout)
        host, port = sentinel.discover_master(service)  # type: ignore[no-untyped-call]
        auth = f":{password}@" if password is not None else ""
        store = cls(f"redis://{auth}{host}:{port}/{db}", timeout=timeout, ttl=ttl,
                    cluster=cluster, ca_certs=ca_certs)
        store.client.close()
        store.client = sentinel.master_for(  # type: ignore[no-untyped-call]
            service, db=db, password=password, socket_timeout=timeout,
            socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        store._nodes.sentinel = (sentinel, service)
        return store

    def held(self, keys: Sequence[bytes]) -> int:
        """``StoreBackend.held``: pipelined EXISTS (one round trip per node), the whole
        call bounded by one deadline, ``timeout`` seconds from now, however the server
        trickles its replies (a per-read bound let a reply of a byte every 20 ms hold a
        64-key lookup 5 s with ``timeout=0.25``: the vLLM connector's lookup on the
        scheduler's thread). The keys not answered by then are not held: the run stops
        at the first of them, as at a node that is down. Raises, only when no key was
        answered, OSError, ConnectionError or TimeoutError (past the deadline; through
        Sentinel, the sentinels are asked for the master again first); ConfigError,
        before any command is sent, unless ``keys`` is a list or tuple of bytes."""
        check_keys("held", keys)
        return self._held([keys])[0]

    def held_runs(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        """``held`` of each run of keys, all asked in one call: one pipelined EXISTS for
        every key (one round trip per node) under one deadline, ``timeout`` seconds from
        now (the vLLM connector's lookup thread asks the runs of a step's requests
        together). Raises as ``held``; ConfigError, before any command is sent, unless
        ``runs`` is a list or tuple of such lists of keys."""
        check_runs(runs)
        return self._held(runs)

    def _held(self, runs: Sequence[Sequence[bytes]]) -> list[int]:
        keys = runs[0] if len(runs) == 1 else [k for run in runs for k in run]
        until = time.monotonic() + self.timeout
        try:
            replies = self._on_nodes(keys, lambda i: pack(b"EXISTS", keys[i]), lambda: until)
        except Exception:
            self._nodes.follow()
            raise
        out, at = [], 0
        for run in runs:
            end = at + len(run)
            out.append(next((i - at for i in range(at, end) if replies[i] != 1), len(run)))
            at = end
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """``StoreBackend.put``: pipelined SET with EX ttl (one round trip per node, each
        value sent from its own buffer); the values refused (an OOM error when the
        server is full under ``noeviction``). The whole call is bounded by one deadline:
        ``timeout`` seconds, and one more for each ``WRITE_FLOOR`` bytes of values, from
        now (a server that takes them in slower, or trickles its replies, fails the
        values not answered by then: the writer's thread, and ``StoreWriter.close``
        behind it, never wait longer). On a cluster, a node that is down, or a key it
        moved (MOVED), refuses that node's values only; the others are stored (a key
        of a migrating slot, ASK, is written on the node it names). Raises, only when
        no value was answered, OSError, ConnectionError or TimeoutError; ConfigError,
        before any command is sent, unless ``items`` is a list or tuple of ``(key,
        value)`` tuples of bytes (a value may be a bytearray or a C-contiguous
        memoryview). Through
        Sentinel, a call that fails or is refused as a whole asks the sentinels for the
        master again."""
        check_items(items)
        ttl = str(self.ttl).encode()
        size = sum([memoryview(v).nbytes for _, v in items])
        until = time.monotonic() + self.timeout + size / WRITE_FLOOR
        try:
            replies = self._on_nodes([k for k, _ in items], lambda i: pack_set(*items[i], ttl),
                                     lambda: until)
        except Exception:
            self._nodes.follow()
            raise
        refused = sum([r != b"OK" for r in replies])
        if refused and refused == len(items):
            self._nodes.follow()  # (through Sentinel: a master turned replica answers READONLY)
        return refused

    def _on_nodes(self, keys: Sequence[bytes], command: Callable[[int], Packed],
                  deadline: Callable[[], float]) -> list[object]:
        """Each key's reply to ``command(i)`` (its packed command), sent node by node on
        connections of ours (on a cluster: redis-py's cluster pipeline fails the whole
        call when one node is down), then read: one round trip per node, overlapping.
        ``deadline()``: the instant by which each step (the slot map, a node's send, a
        node's replies) must be done. A key whose node failed gets the exception; a key
        the cluster moved gets its MOVED RespError; either way the slot map is read
        again on the next call. A key answered ASK (its slot migrating) gets the reply
        of the node named (``Nodes.ask_again``). Raises when no node answered (never for no
        keys)."""
        if not keys:
            return []
        nodes = self._nodes
        replies: list[object] = [None] * len(keys)
        failure: Exception | None = None
        answered = False
        asks: dict[Address, list[int]] = {}
        for asked in nodes.rounds(keys, deadline()):
            sent: list[tuple[Resp, list[int]]] = []
            for node, idx in asked:
                fair = time.monotonic() < deadline()  # (else another node took its time)
                cmds = [command(i) for i in idx]  # (bytes joined in C; tuples: values unjoined)
                try:
                    sent.append((nodes.send(node, cmds if type(cmds[0]) is tuple
                                            else b"".join(cast("list[bytes]", cmds)), deadline()),
                                 idx))
                except Exception as exc:
                    failure = nodes.failed(node, idx, replies, exc, fair)
            for conn, idx in sent:
                pos, until = 0, deadline()
                fair = time.monotonic() < until
                try:
                    for i in idx:
                        replies[i] = reply = conn.reply(until)
                        answered = True
                        pos += 1
                        if isinstance(reply, RespError):
                            nodes.redirected(reply, i, asks)
                    nodes.give(conn)
                except Exception as exc:
                    conn.close()
                    failure = nodes.failed(conn.address, idx[pos:], replies, exc, fair)
        if asks:
            nodes.ask_again(asks, command, lambda conn, i: conn.reply(deadline()), replies, deadline())
        if failure is not None and not answered:
            raise failure
        return replies

    def read_into(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]],
                  deadline: float) -> list[ReadOutcome]:
        """``StoreBackend.read_into``: pipelined GETs, one round trip per node. Raises
        when no node answered (OSError, ConnectionError, TimeoutError at the deadline);
        ConfigError, before any command is sent, for keys that are not bytes, buffers
        that are not one list of writable contiguous byte memoryviews (format ``"B"``,
        one dimension: ``memoryview(x).cast("B")``) per key, or a deadline
        that is not a finite number (``redis_args.check_reads``)."""
        check_reads(keys, buffers, deadline)
        nodes = self._nodes
        out: list[ReadOutcome] = [None] * len(keys)
        failure: Exception | None = None
        answered = False
        asks: dict[Address, list[int]] = {}
        for asked in nodes.rounds(keys, deadline):
            sent: list[tuple[Resp, list[int]]] = []
            for node, idx in asked:  # send every node its GETs, then read
                # (not fair: another node took its time; one node: nothing to suspect)
                fair = self.cluster and time.monotonic() < deadline
                try:
                    sent.append((nodes.send(node, b"".join([pack(b"GET", keys[i]) for i in idx]),
                                            deadline), idx))
                except Exception as exc:
                    failure = nodes.failed(node, idx, out, exc, fair)
            for conn, idx in sent:
                pos, fair = 0, self.cluster and time.monotonic() < deadline
                try:
                    for i in idx:
                        views = buffers[i]
                        out[i] = r = conn.bulk_into(views, sum([v.nbytes for v in views]), deadline)
                        answered = True
                        pos += 1
                        if not pos % YIELD_EVERY:
                            time.sleep(0)  # let the scheduler's thread have the GIL
                        if isinstance(r, RespError):
                            nodes.redirected(r, i, asks)
                    nodes.give(conn)
                except Exception as exc:
                    conn.close()
                    failure = nodes.failed(conn.address, idx[pos:], out, exc, fair)
        if asks:
            nodes.ask_again(asks, lambda i: pack(b"GET", keys[i]), lambda conn, i: conn.bulk_into(
                buffers[i], sum([v.nbytes for v in buffers[i]]), deadline), out, deadline)
        if failure is not None and not answered:
            nodes.follow()
            raise failure
        return out

    def close(self) -> None:
        """Close the connections (a later call opens new ones)."""
        self.client.close()
        self._nodes.close()
