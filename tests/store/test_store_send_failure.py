"""A request that could not be sent whole, on a real redis-server: the connection it
was half written on must be closed at once, never kept open beside the pool (the
server would read, and answer, the half it got)."""

import os
import signal
import time

import pytest
import redis

from prefixkv.store import RedisStore
from prefixkv.store.server import LocalRedis
from waiting import LIVE, wait_until


def clients(server: LocalRedis) -> int:
    """The connections the server holds, less the one asking."""
    with redis.Redis(unix_socket_path=server.socket, socket_timeout=LIVE) as r:
        return int(r.info("clients")["connected_clients"]) - 1


def test_a_read_whose_send_fails_closes_its_connection():
    """SIGSTOP on the server, then a read of 100k keys (megabytes of GETs, more than
    the socket's buffers take): the send fails at the read's deadline. Once the server
    goes on, it holds no connection of the store's, while the failure (its traceback,
    which held the connection) is still at hand."""
    with LocalRedis() as server:
        store = RedisStore(server.url, timeout=LIVE)
        keys = [f"half-written-{i:08d}".encode() for i in range(100_000)]
        view = memoryview(bytearray(8))
        os.kill(server._proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError) as failed:
                store.read_into(keys, [[view]] * len(keys), time.monotonic() + 0.3)
        finally:
            os.kill(server._proc.pid, signal.SIGCONT)
        wait_until(lambda: clients(server) == 0, "the half-written connection to close",
                   timeout=3 * LIVE)
        assert failed.value is not None
        store.close()
