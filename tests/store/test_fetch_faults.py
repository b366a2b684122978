"""Faults around the asynchronous fetch on a real Redis: executors that shut down while a
fetch is queued or under way, a store closed while a fetch runs. Each fetch must land (or
fail) exactly once, leaving no host slot reserved and no fetch in flight (else
``reset_prefix_cache`` refuses for ever). Block size 4, 8-byte payloads."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixkv import BlockLoads, ConfigError, KVCacheManager, StoreWait
from prefixkv.store import RedisStore, SharedStore, StoreLayout
from prefixkv.store.local_cluster import LocalCluster
from prefixkv.store.server import LocalRedis
from waiting import LIVE, PATIENCE, wait_until

from .conftest import always
from .test_shared_store import A, admit, computed, from_store
from .test_store_cluster import DOC
from .test_store_cluster import manager as cluster_manager
from .test_store_cluster import setup as cluster_setup


def stored(backend, layout):
    """A store holding A's three blocks, written by another manager."""
    computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4,
                            store=SharedStore(backend, layout, cost=always(), timeout=LIVE)),
             backend, "w", A)


def waiting_manager(backend, layout, executor, **kw):
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE, executor=executor, **kw)
    return KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared), shared


def test_an_executor_shut_down_with_a_fetch_queued_still_lands_it(backend, layout):
    """A ``ThreadPoolExecutor`` shut down (``wait=False``) runs what was queued, but
    refuses what that hands over: the fetch's first call raised at the submission of its
    second part, so the fetch never ended: its slots stayed reserved and it stayed in
    flight for ever."""
    stored(backend, layout)
    ex = ThreadPoolExecutor(1)
    gate = threading.Event()
    ex.submit(gate.wait, PATIENCE)                   # the thread is busy: the fetch queues
    m, _ = waiting_manager(backend, layout, ex, connections=2)
    assert m.add_request("b", A) == StoreWait("b", 3)
    ex.shutdown(wait=False)                          # the engine exits; queued calls still run
    gate.set()
    ex.shutdown(wait=True)                           # (joins: what it ran has ended)
    assert len(m._waits.link.done) == 1
    assert m.poll_store() == ["b"]
    assert m._host.num_landing == 0 and m._waits.in_flight == 0
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()
    m.free("b")
    assert m.reset_prefix_cache()


def test_a_store_closed_while_a_fetch_runs_waits_for_all_its_parts(backend, layout, monkeypatch):
    """``SharedStore.close`` drops its threads before it waits for them; a fetch that was
    preparing then handed its later parts to ``store.executor``, which started a new
    set of threads: ``close`` returned with parts still to read, and left threads behind."""
    import prefixkv.store.link as link_module

    stored(backend, layout)
    gate, preparing = threading.Event(), threading.Event()
    prepare = link_module.prepare

    def held(*args):
        preparing.set()
        assert gate.wait(PATIENCE)
        return prepare(*args)

    monkeypatch.setattr(link_module, "prepare", held)
    m, shared = waiting_manager(backend, layout, None, connections=2)
    threads = shared.executor
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert preparing.wait(PATIENCE)
    closing = threading.Thread(target=shared.close)
    closing.start()
    wait_until(lambda: shared._executor is None, "close to begin")
    gate.set()
    closing.join(PATIENCE)
    assert not closing.is_alive()
    assert shared._executor is None                  # no new threads started
    assert all(not t.is_alive() for t in threads._threads)
    assert len(m._waits.link.done) == 1              # every part was read before close returned
    assert m.poll_store() == ["b"] and m._host.num_landing == 0
    assert m.add_request("b", A).num_cached_tokens == 12
    m.check_invariants()


def test_a_server_paused_mid_fetch_fails_it_at_its_one_deadline_and_serves_after():
    """SIGSTOP on a real redis-server holding the blocks, with the client's connections
    open: the fetch (two parts in parallel) ends failed at its deadline, one error, no
    slot kept; once the server goes on, the replies it then sends to the closed
    connections are never read as another fetch's, and the next fetch hits."""
    with LocalRedis() as server:
        backend = RedisStore(server.url, timeout=LIVE)
        layout = StoreLayout("paused", "float32", 8)
        writer = SharedStore(backend, layout, cost=always(), timeout=LIVE)
        computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=writer),
                 backend, "w", A)
        shared = SharedStore(backend, layout, cost=always(), timeout=0.3, retry_after=0,
                             connections=2)
        m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared)
        assert from_store(m, A) == 12                # connections open, idle in the pool
        m.reset_prefix_cache(keep_store=True)
        os.kill(server._proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            adm = admit(m, "a", A)
            took = time.monotonic() - t
        finally:
            os.kill(server._proc.pid, signal.SIGCONT)
        assert took < 0.3 + 5                        # the deadline, and a busy machine's delays
        assert (adm.num_cached_tokens, adm.num_new_tokens) == (0, 13)
        assert m.stats.store_errors == 1 and m._host.num_landing == 0
        m.check_invariants()
        m.free("a", num_computed_tokens=0)
        m.reset_prefix_cache(keep_store=True)
        assert from_store(m, A) == 12 and m.stats.store_errors == 1
        m.check_invariants()
        backend.close()


def test_two_waits_on_one_chain_and_a_readmission_with_another_prompt_on_real_threads(backend, layout):
    """On the store's own fetch threads: two requests wait on the same three blocks, a
    third waits and is freed, then re-added under its id with another prompt before its
    first fetch ended. The first landing serves both waiters (the second lands nothing
    twice), the stale fetch lands as cached content and is never reported for the new
    prompt, and every reserved slot comes back."""
    stored(backend, layout)
    shared = SharedStore(backend, layout, cost=always(), timeout=LIVE)
    m = KVCacheManager(16, 4, hash_mode="sha256", host_blocks=12, store=shared)
    assert m.add_request("b", A) == StoreWait("b", 3)
    assert m.add_request("c", A + [99]) == StoreWait("c", 3)
    assert m.add_request("d", A) == StoreWait("d", 3)
    m.free("d")                                      # left while waiting
    other = [7] * 9                                  # two full blocks the store never held
    assert m.add_request("d", other) == StoreWait("d", 2)   # a fetch of its own
    ended = []
    wait_until(lambda: ended.extend(m.poll_store()) or not m._waits.in_flight, "every fetch to land")
    assert sorted(ended) == ["b", "c", "d"]          # each once; the stale fetch for nobody
    assert m._host.num_landing == 0 and m._waits.reserved == 0
    adm = m.add_request("d", other)                  # found nothing: computed
    assert adm.num_cached_tokens == 0 and adm.num_new_tokens == 9
    assert m.add_request("b", A).num_cached_tokens == 12
    assert m.add_request("c", A + [99]).num_cached_tokens == 12
    # the run on the device once (its slots held its payload until the loads ran: the
    # tier keeps none of it), no content twice
    assert m.stats.store_errors == 0 and len(m._host) == 0 and m.lookup_block_ids(A) == \
        m.get_block_ids("b")[:3]
    m.check_invariants()
    for rid in "bcd":
        m.free(rid)
    assert m.reset_prefix_cache()
    shared.close()


def test_a_server_killed_mid_fetch_fails_it_at_once_and_a_restart_serves_again():
    """The server (paused, so the fetch is surely under way) is killed: the fetch ends
    failed when its connections close, long before its deadline, one error and no slot
    kept; a restarted server is reconnected to and serves what is written to it."""
    with LocalRedis() as server:
        backend = RedisStore(server.url, timeout=LIVE)
        layout = StoreLayout("killed", "float32", 8)
        shared = SharedStore(backend, layout, cost=always(), timeout=PATIENCE, retry_after=0)
        computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared),
                 backend, "w", A)
        m = KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared)
        os.kill(server._proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        assert m.add_request("a", A) == StoreWait("a", 3)
        os.kill(server._proc.pid, signal.SIGKILL)
        wait_until(lambda: m.poll_store() == ["a"], "the fetch to fail")
        assert time.monotonic() - t < PATIENCE / 2   # at the kill, not at the deadline
        assert m.stats.store_errors == 1 and m._host.num_landing == 0
        adm = m.add_request("a", A)
        assert (adm.num_cached_tokens, adm.num_new_tokens) == (0, 13)
        m.free("a", num_computed_tokens=0)
        server.stop()
        server.start()                               # empty
        computed(KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared),
                 backend, "w2", A)
        m.reset_prefix_cache(keep_store=True)
        assert from_store(m, A) == 12 and m.stats.store_errors == 1
        m.check_invariants()
        backend.close()


def test_a_cluster_master_killed_mid_fetch_costs_its_keys_only():
    """A Redis Cluster whose master holding block 5 is paused while a fetch of ten
    blocks reads, then killed: the other masters' answers stand, the run ends at the
    first lost key (one error, the store not left alone), the fetch ends at the kill,
    and the next fetch reads the same run again."""
    with LocalCluster(node_timeout=60_000) as c:
        backend, shared, puts, admin, nodes = cluster_setup(c)
        shared.timeout = PATIENCE
        victim = nodes[5] if nodes[5] != nodes[0] else next(p for p in nodes[5:] if p != nodes[0])
        first_lost = nodes.index(victim)
        m = cluster_manager(shared)
        assert from_store(m, DOC) == 40                 # the map is known, every node read
        m.reset_prefix_cache(keep_store=True)
        os.kill(c._procs[victim].pid, signal.SIGSTOP)
        t = time.monotonic()
        assert isinstance(m.add_request("b", DOC), StoreWait)
        c.kill(victim)
        wait_until(lambda: m.poll_store() == ["b"], "the fetch to end")
        assert time.monotonic() - t < PATIENCE / 2
        assert m.add_request("b", DOC).num_cached_tokens == 4 * first_lost
        assert m.stats.store_errors == 1 and m._host.num_landing == 0
        m.free("b")
        m.check_invariants()
        m2 = cluster_manager(shared)
        assert from_store(m2, DOC) == 4 * first_lost and m2.stats.store_errors == 1
        admin.close()
        backend.close()


def test_host_memory_is_not_attached_again_while_a_fetch_reads_into_it(backend, layout):
    """Attached again while a fetch was under way (the engine moved its host caches,
    copying what they held), the memory changed under the fetch: it read into the old
    buffers, its run landed, and the loads read the new ones, which never got the
    payloads (wrong KV served)."""
    from .test_store_fetch import Manual

    stored(backend, layout)
    ex = Manual()
    m, _ = waiting_manager(backend, layout, ex)
    old, new = bytearray(32), bytearray(32)
    views = lambda mem: [[memoryview(mem)[8 * i:8 * (i + 1)]] for i in range(4)]  # noqa: E731
    m.attach_host_memory(views(old))
    assert m.add_request("b", A) == StoreWait("b", 3)
    with pytest.raises(ConfigError, match="under way"):
        m.attach_host_memory(views(new))
    ex.run()                                         # reads into ``old``, still attached
    assert m.poll_store() == ["b"]
    new[:] = old                                     # moved now, between fetches
    m.attach_host_memory(views(new))
    adm = m.add_request("b", A)
    (loads,) = [op for op in m.take_kv_ops() if isinstance(op, BlockLoads)]
    assert adm.num_cached_tokens == 12
    assert [bytes(new[8 * s:8 * s + 8]) for s in loads.src] == [bytes([i]) * 8 for i in range(3)]
    m.check_invariants()
